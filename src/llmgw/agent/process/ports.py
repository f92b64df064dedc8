"""Port ownership, the shell around discovery/procnet.py: is a port free, and who holds it.

An engine's health counts only when the socket answering on its port belongs to a
process of the engine's own session: a 200 from anybody else (another cluster's engine
on the same port base) is a port conflict. Linux only: where /proc/net/tcp cannot be
read, nothing is known and nothing is claimed.

Blocking calls (a /proc walk): the supervisor runs `owner_conflict` in a thread.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys

from llmgw.agent.discovery.procnet import (
    Listener,
    PortConflict,
    answering,
    command_line,
    parse_tcp_table,
    socket_inode,
)
from llmgw.agent.process import procs

log = logging.getLogger(__name__)

TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
PROC = "/proc"


def port_free(addr: str, port: int) -> bool:
    """Whether `addr`:`port` can be bound now (SO_REUSEADDR, as engines' servers set it,
    so a connection in TIME_WAIT does not count as taken)."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return True  # cannot tell; the engine will say
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
        except OSError as exc:
            return exc.errno != errno.EADDRINUSE
    return True


def read_listeners(tables: tuple[str, ...] = TCP_TABLES) -> tuple[Listener, ...] | None:
    """Every LISTEN socket of this network namespace; None when no table is readable."""
    out: list[Listener] = []
    read = False
    for path in tables:
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            continue
        read = True
        out.extend(parse_tcp_table(text, byteorder=sys.byteorder))
    return tuple(out) if read else None


def socket_inodes(pid: int, proc: str = PROC) -> set[int] | None:
    """The socket inodes among `pid`'s open files; None where they cannot be read."""
    folder = f"{proc}/{pid}/fd"
    found: set[int] = set()
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    for name in names:
        try:
            inode = socket_inode(os.readlink(f"{folder}/{name}"))
        except OSError:
            continue
        if inode is not None:
            found.add(inode)
    return found


def _cmdline(pid: int, proc: str) -> str:
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            return command_line(f.read(4096))
    except OSError:
        return ""


def holders(inodes: frozenset[int], proc: str = PROC) -> tuple[tuple[int, str], ...]:
    """(pid, command line) of the visible processes that hold any of `inodes`."""
    if not inodes:
        return ()
    out: list[tuple[int, str]] = []
    try:
        pids = sorted(int(n) for n in os.listdir(proc) if n.isdigit())
    except OSError:
        return ()
    for pid in pids:
        if (socket_inodes(pid, proc) or set()) & inodes:
            out.append((pid, _cmdline(pid, proc)))
    return tuple(out)


def listening_on(addr: str, port: int) -> frozenset[int] | None:
    """Inodes of the sockets that would answer `addr`:`port`; None: cannot tell."""
    listeners = read_listeners()
    if listeners is None:
        return None
    return answering(listeners, addr, port)


def taken_by(addr: str, port: int) -> PortConflict:
    """The conflict to report for a port that is taken (holders where visible)."""
    inodes = listening_on(addr, port) or frozenset()
    return PortConflict(port, holders(inodes))


def owner_conflict(addr: str, port: int, sid: int) -> PortConflict | None:
    """None when the socket answering on `addr`:`port` belongs to session `sid` (or
    nothing can be told); else the conflict, with the holders of that socket."""
    inodes = listening_on(addr, port)
    if not inodes:
        return None  # no /proc, or the listener is gone already: nothing to claim
    pids = procs.session_pids(sid)
    ours: set[int] = set()
    unreadable = 0
    for pid in pids:
        got = socket_inodes(pid)
        if got is None:
            unreadable += 1
        else:
            ours |= got
    if inodes & ours:
        return None
    if pids and unreadable == len(pids):
        return None  # the session's files are hidden from us: cannot tell, claim nothing
    return PortConflict(port, holders(inodes))

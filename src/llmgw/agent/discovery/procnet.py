"""Who listens on a port, from /proc text: pure parsers, no I/O (the shell is agent/process/ports.py).

- `/proc/net/tcp` and `/proc/net/tcp6`: one socket a line; the LISTEN ones (state 0A)
  give (local address, port, socket inode).
- `/proc/PID/stat`: field 6 is the session id.
- `/proc/PID/fd/N` links: a socket reads `socket:[INODE]`.
- `/proc/PID/cmdline`: NUL-separated argv.

Every parser is total: text it cannot read gives nothing (or None), never an exception.
"""

from __future__ import annotations

import ipaddress
import re

from attrs import frozen

LISTEN = "0A"
WILDCARDS = ("0.0.0.0", "::")
CMDLINE_MAX = 200

_SOCKET_LINK = re.compile(r"socket:\[([0-9]+)\]")


@frozen
class Listener:
    addr: str  # e.g. "127.0.0.1", "::", "::1"
    port: int
    inode: int


def _addr(hexaddr: str, byteorder: str) -> str | None:
    """The address of a /proc/net/tcp{,6} field: 32-bit words in host byte order."""
    if len(hexaddr) not in (8, 32):
        return None
    try:
        raw = bytes.fromhex(hexaddr)
    except ValueError:
        return None
    if byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw))
    return str(ipaddress.IPv6Address(raw))


def parse_tcp_table(text: str, *, byteorder: str = "little") -> tuple[Listener, ...]:
    """The LISTEN sockets of a /proc/net/tcp or /proc/net/tcp6 table.

    `byteorder`: the host's (sys.byteorder); the kernel writes addresses as host-order words.
    """
    out: list[Listener] = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 10 or not fields[0].endswith(":") or fields[3] != LISTEN:
            continue
        local = fields[1].split(":")
        if len(local) != 2 or len(local[1]) != 4:
            continue
        addr = _addr(local[0], byteorder)
        try:
            port = int(local[1], 16)
            inode = int(fields[9])
        except ValueError:
            continue
        if addr is None or inode <= 0:
            continue
        out.append(Listener(addr, port, inode))
    return tuple(out)


def answering(listeners: tuple[Listener, ...], addr: str, port: int) -> frozenset[int]:
    """The inodes of the sockets that accept a connection to `addr`:`port`.

    A socket bound to the exact address wins over a wildcard one (as the kernel's lookup
    does); `::` takes IPv4 too (dual stack). An `addr` that is not an IP literal (a host
    name): every listener on the port.
    """
    on_port = [s for s in listeners if s.port == port]
    try:
        want = ipaddress.ip_address(addr)
    except ValueError:
        return frozenset(s.inode for s in on_port)
    exact = set()
    for s in on_port:
        got = ipaddress.ip_address(s.addr)
        if isinstance(got, ipaddress.IPv6Address) and got.ipv4_mapped is not None:
            got = got.ipv4_mapped
        if got == want:
            exact.add(s.inode)
    if exact:
        return frozenset(exact)
    v4 = isinstance(want, ipaddress.IPv4Address)
    wild = {s.inode for s in on_port if s.addr == "::" or (v4 and s.addr == "0.0.0.0")}
    return frozenset(wild)


def stat_fields(text: str) -> list[str] | None:
    """The fields of a /proc/PID/stat line from field 3 (state) on; None for text that is
    not one. The command name (field 2) is in parentheses and may hold spaces or ')'."""
    end = text.rfind(")")
    if end < 0:
        return None
    return text[end + 1 :].split() or None


def session_of_stat(text: str) -> int | None:
    """Field 6 (session id) of a /proc/PID/stat line; None for a zombie or unreadable text."""
    fields = stat_fields(text)
    # fields[0] is field 3 (state); the session id is field 6.
    if fields is None or len(fields) < 4 or fields[0] in ("Z", "X"):
        return None
    try:
        return int(fields[3])
    except ValueError:
        return None


def socket_inode(link: str) -> int | None:
    """The inode of a `socket:[INODE]` fd link; None for any other link."""
    m = _SOCKET_LINK.fullmatch(link)
    return int(m.group(1)) if m else None


def command_line(raw: bytes, limit: int = CMDLINE_MAX) -> str:
    """A /proc/PID/cmdline as one line, clipped to `limit` characters (with an ellipsis)."""
    words = [w.decode(errors="replace") for w in raw.split(b"\0") if w]
    line = " ".join(" ".join(words).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


@frozen
class PortConflict:
    """`port` answers, but not from the engine's session. `holders`: (pid, command) of
    the processes holding its listening socket, where this agent may see them."""

    port: int
    holders: tuple[tuple[int, str], ...] = ()

    @property
    def reason(self) -> str:
        if not self.holders:
            return f"port {self.port} is in use by another process (not visible to the agent)"
        shown = ", ".join(f"pid {pid} ({cmd})" if cmd else f"pid {pid}"
                          for pid, cmd in self.holders[:3])
        more = f" and {len(self.holders) - 3} more" if len(self.holders) > 3 else ""
        return f"port {self.port} is in use by {shown}{more}"

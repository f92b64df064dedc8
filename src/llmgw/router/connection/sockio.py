"""Socket I/O for the router's hot path: plain non-blocking sockets, trio only to wait.

trio's SocketStream passes through the scheduler after every send or receive that
completed at once (a checkpoint: one more scheduler round, one more epoll_wait). Here an
operation that completes at once returns at once; the task waits only when the kernel
says it must (wait_readable / wait_writable, which are checkpoints). So that no task can
run for long without the scheduler seeing it (fairness, cancellation), a full checkpoint
is taken before an operation once YIELD_EVERY operations in a row completed without any
task waiting (the count is global: it bounds the time between scheduler rounds).

Errors come out as trio's: a reset or broken connection is trio.BrokenResourceError,
a socket closed under us trio.ClosedResourceError. `close` wakes any task waiting on the
socket (trio.lowlevel.notify_closing) before closing it.
"""

from __future__ import annotations

import errno
import logging
import socket

import trio
from trio.lowlevel import checkpoint, notify_closing, wait_readable, wait_writable

log = logging.getLogger(__name__)

RECV = 65536
YIELD_EVERY = 24

_budget = YIELD_EVERY


def adopt(stream: trio.SocketStream) -> socket.socket:
    """The plain socket under a trio SocketStream (which is left detached), TCP_NODELAY."""
    sock = socket.socket(fileno=stream.socket.detach())
    sock.setblocking(False)
    set_nodelay(sock)
    return sock


def set_nodelay(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError as exc:  # not TCP (unix sockets) or already closed
        log.debug("TCP_NODELAY not set: %s", exc)


def close(sock: socket.socket) -> None:
    """Close now, without awaiting (safe inside a cancelled scope): the peer sees EOF."""
    if sock.fileno() < 0:
        return
    try:
        notify_closing(sock)
        sock.close()
    except (OSError, ValueError) as exc:
        log.debug("closing a socket: %s", exc)


def _error(exc: OSError) -> Exception:
    if exc.errno == errno.EBADF:
        return trio.ClosedResourceError("socket was already closed")
    return trio.BrokenResourceError(f"socket connection broken: {exc}")


async def recv(sock: socket.socket, n: int = RECV) -> bytes:
    """Whatever has arrived (b"" at EOF); waits only when nothing has."""
    global _budget
    _budget -= 1
    if _budget <= 0:
        _budget = YIELD_EVERY
        await checkpoint()
    while True:
        try:
            return sock.recv(n)
        except BlockingIOError:
            pass
        except OSError as exc:
            raise _error(exc) from exc
        _budget = YIELD_EVERY
        await wait_readable(sock)


async def recv_next(sock: socket.socket, n: int = RECV) -> bytes:
    """Like `recv`, for a socket whose last receive just took what there was: the peer is
    most likely not done sending its next message yet, so this waits for readability
    first rather than try a receive that would fail with EAGAIN (a system call and a
    Python exception saved per message). Waiting on a socket that is readable already
    returns at the next scheduler round."""
    global _budget
    _budget = YIELD_EVERY
    await wait_readable(sock)
    return await recv(sock, n)


def send_now(sock: socket.socket, data: bytes) -> int:
    """Send what the kernel takes at once, without waiting; returns how much it took
    (the rest goes with `send_all`). Counts against the budget like `send_all`: the next
    operation that may wait takes the checkpoint when it is due."""
    global _budget
    _budget -= 1
    try:
        return sock.send(data)
    except BlockingIOError:
        return 0
    except OSError as exc:
        raise _error(exc) from exc


async def send_all(sock: socket.socket, data: bytes) -> None:
    global _budget
    _budget -= 1
    if _budget <= 0:
        _budget = YIELD_EVERY
        await checkpoint()
    try:
        sent = sock.send(data)
    except BlockingIOError:
        sent = 0
    except OSError as exc:
        raise _error(exc) from exc
    if sent == len(data):
        return
    view = memoryview(data)[sent:]
    while view:
        _budget = YIELD_EVERY
        await wait_writable(sock)
        try:
            sent = sock.send(view)
        except BlockingIOError:
            continue
        except OSError as exc:
            raise _error(exc) from exc
        view = view[sent:]

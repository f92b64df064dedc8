"""pyzmq sockets under trio.

ZMQ_FD is edge-triggered and can be consumed by almost any call on the socket, so:
- every operation first tries with NOBLOCK, and waits only when ZMQ_EVENTS says the
  socket is not ready for it;
- exactly one task at a time waits on the FD (trio allows one reader per fd); the others
  park and re-check ZMQ_EVENTS whenever the waiter wakes;
- after every send and receive ZMQ_EVENTS is read again, and anyone waiting is woken
  when it shows what they wait for, because the FD may not fire for that change;
- the wait on the FD is bounded (a missed edge costs at most `_SAFETY` seconds), as
  pyzmq's own gevent integration does.
"""

from __future__ import annotations

import logging
from typing import Any

import trio
import zmq

log = logging.getLogger(__name__)

_SAFETY = 1.0  # seconds; bound on a wait that a missed edge would otherwise make endless
# Plain ints: arithmetic on pyzmq's IntFlag members goes through enum's machinery (about a
# microsecond each, on every receive and send).
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)


class TrioSocket:
    """A zmq socket usable from many trio tasks. Not thread-safe (nor is zmq)."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self.sock = sock
        self._fd = int(sock.getsockopt(zmq.FD))
        self._waiter_scope: trio.CancelScope | None = None
        self._lot = trio.lowlevel.ParkingLot()
        self._waiting_for = 0  # union of POLLIN/POLLOUT that tasks are waiting for
        self._closed = False

    # ---- waiting ----

    def _events(self) -> int:
        return int(self.sock.get(_EVENTS))

    async def _wait(self, flag: int) -> None:
        """Return once ZMQ_EVENTS shows `flag` (or the socket was closed)."""
        while True:
            if self._closed:
                raise trio.ClosedResourceError("socket closed")
            if self._events() & flag:
                return
            self._waiting_for |= flag
            if self._waiter_scope is not None:
                # Someone already owns the FD; they wake us whenever it fires.
                await self._lot.park()
                continue
            # One scope: cancelled by _after_io when another task's operation shows the
            # change, or at its deadline (the bound on a missed edge).
            with trio.CancelScope(deadline=trio.current_time() + _SAFETY) as scope:
                self._waiter_scope = scope
                try:
                    await trio.lowlevel.wait_readable(self._fd)
                finally:
                    self._waiter_scope = None
                    self._waiting_for = 0
                    self._lot.unpark_all()

    def _after_io(self) -> None:
        """An operation may have changed readiness without the FD firing: re-read EVENTS."""
        if not self._waiting_for or self._closed:
            return
        if self._events() & self._waiting_for:
            if self._waiter_scope is not None:
                self._waiter_scope.cancel()
            self._lot.unpark_all()

    # ---- receiving ----

    async def recv_frames(self) -> list[zmq.Frame]:
        """One multipart message as frames (frames carry the ZAP User-Id)."""
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                await self._wait(zmq.POLLIN)
                continue
            self._after_io()
            return frames

    def recv_frames_nowait(self) -> list[zmq.Frame] | None:
        """One message if one is queued now, else None: lets a reader drain a burst
        without a trip through the scheduler per message."""
        try:
            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        self._after_io()
        return frames

    def readable(self) -> bool:
        """Whether a message is queued now (reading ZMQ_EVENTS also re-arms the FD's edge)."""
        return bool(self._events() & _POLLIN)

    async def wait_readable(self) -> None:
        """Return once a message is queued. For a reader that drains with the socket's own
        NOBLOCK receives while `readable()` holds, which is cheaper than an `Again` each
        time the queue runs dry."""
        await self._wait(zmq.POLLIN)

    async def recv_multipart(self) -> list[bytes]:
        return [f.bytes for f in await self.recv_frames()]

    # ---- sending ----

    async def send_multipart(self, parts: list[bytes]) -> None:
        """Send, waiting (without blocking trio) while the high-water mark is reached."""
        while True:
            try:
                self.sock.send_multipart(parts, zmq.NOBLOCK)
            except zmq.Again:
                await self._wait(zmq.POLLOUT)
                continue
            self._after_io()
            return

    def try_send_routed(self, routing_id: bytes, payload: bytes) -> bool:
        """Send [routing_id, payload] on a ROUTER now or not at all: POLLOUT says nothing
        about one peer, so a peer at its high-water mark, or gone, loses this message (the
        caller logs it); so does any peer once the socket is closed. Two sends, the first
        with SNDMORE: with ROUTER_MANDATORY an unknown or full peer fails on the first
        frame, so nothing half-sent is left behind."""
        if self._closed:
            return False
        sock = self.sock
        try:
            sock.send(routing_id, _NOBLOCK_MORE)
            sock.send(payload, _NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise
        finally:
            self._after_io()
        return True

    def try_send_parts(self, parts: list[bytes], *, copy: bool = True) -> int:
        """Send a multipart message now or not at all; 0 when sent, else why not:
        zmq.EAGAIN (at the high-water mark: on a ROUTER_MANDATORY socket, that peer's) or
        zmq.EHOSTUNREACH (a ROUTER_MANDATORY socket's peer, parts[0], is not connected);
        zmq.ENOTSOCK once the socket is closed. As in try_send_routed, a refusal comes at
        the first frame, so nothing half-sent is left behind. `copy=False` lends large
        frames to libzmq instead of copying them (one payload sent to many peers)."""
        if self._closed:
            return zmq.ENOTSOCK
        sock = self.sock
        try:
            for part in parts[:-1]:
                sock.send(part, _NOBLOCK_MORE, copy=copy)
            sock.send(parts[-1], _NOBLOCK, copy=copy)
        except zmq.Again:
            return zmq.EAGAIN
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return zmq.EHOSTUNREACH
            raise
        finally:
            self._after_io()
        return 0

    # ---- closing ----

    def close(self, linger: int = 0) -> None:
        if self._closed:
            return
        self._closed = True
        trio.lowlevel.notify_closing(self._fd)
        self._lot.unpark_all()
        self.sock.close(linger=linger)

    def __enter__(self) -> TrioSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

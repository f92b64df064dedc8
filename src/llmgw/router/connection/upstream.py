"""Pooled keep-alive HTTP/1.1 connections to engines (the relay of an answer over them is
relay.py).

An engine's answers are read by the sans-IO parsers of `llmgw.http1` (ResponseParser: the
head, 1xx skipped, and small whole bodies); this module only does the I/O.

`UpstreamPool.acquire` hands out an idle connection to (host, port) or dials a new one
(TCP_NODELAY, bounded by the connect timeout). At most `max_connecting` dials per engine
are under way at once; more wait their turn, first come first served, and the wait is not
the engine's (the connect timeout starts when the dial does). The connect timeout counts
only the time the router was there to see the connect finish: when the deadline passes,
the time the loop spent elsewhere meanwhile (`lag.LagMeter.late_between`) is added to it
and the dial goes on waiting, on the same socket, so that a connect the kernel completed
while the router was busy is taken, not blamed on the engine. A connection goes back to the pool only
when both sides finished the exchange cleanly; anything else (a client that went away
mid-stream, a timeout, an error) closes it, which is how the engine learns to stop
generating. Idle connections older than `max_idle` are dropped rather than reused, since
engines close theirs after a few seconds of quiet.
"""

from __future__ import annotations

import os
import socket

import trio
from trio.lowlevel import wait_writable

from llmgw.http1.grammar import H1Error
from llmgw.http1.response import ResponseHead, ResponseParser
from llmgw.router.connection import sockio
from llmgw.router.connection.lag import LagMeter


class ConnectFailed(OSError):
    """Refused, unreachable or too slow to connect: eject the replica and try another."""


# A response that is not HTTP/1.1 as we accept it (llmgw.http1's rules), or an engine
# that ended the exchange before answering.
ProtocolError = H1Error
Head = ResponseHead


class UpstreamConn:
    __slots__ = ("sock", "parser", "key", "reused", "idle_since", "clean")

    def __init__(self, sock: socket.socket, key: tuple[str, int]) -> None:
        self.sock = sock
        self.parser = ResponseParser()  # holds the bytes received past the head
        self.key = key
        self.reused = False
        self.idle_since = 0.0
        self.clean = False  # the last exchange ended cleanly and may be followed by another

    async def send_request(self, head: bytes, body: bytes) -> None:
        self.clean = False
        if len(body) < 65536:
            await sockio.send_all(self.sock, head + body)
        else:
            await sockio.send_all(self.sock, head)
            await sockio.send_all(self.sock, body)

    async def read_head(self) -> Head:
        """The response head (1xx skipped). EOF before it raises ProtocolError."""
        p = self.parser
        while (head := p.head()) is None:
            data = await sockio.recv(self.sock)
            if data:
                p.feed(data)
            else:
                p.eof()
        return head

    async def read_body(self) -> bytes:
        """The whole (small) body of the answer whose head was read: /metrics and the like."""
        p = self.parser
        while (body := p.body()) is None:
            data = await sockio.recv(self.sock)
            if data:
                p.feed(data)
            else:
                p.eof()
        self.clean = p.clean
        return body


class UpstreamPool:
    def __init__(
        self,
        connect_timeout: float,
        max_idle: float = 3.0,
        max_idle_per_host: int = 512,
        *,
        max_connecting: int = 64,
        lag: LagMeter | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.max_idle_per_host = max_idle_per_host
        self.max_connecting = max_connecting
        self.lag = lag
        self._idle: dict[tuple[str, int], list[UpstreamConn]] = {}
        # Per engine, the dials under way (a FIFO semaphore); dropped when nobody uses it.
        self._dialing: dict[tuple[str, int], trio.Semaphore] = {}
        self.opened = 0  # new connections dialled, for the metrics
        self.forgiven = 0  # connect deadlines moved on for the router's own lateness

    async def acquire(self, host: str, port: int, fresh: bool = False) -> UpstreamConn:
        key = (host, port)
        idle = self._idle.get(key)
        if idle and not fresh:
            now = trio.current_time()
            while idle:
                c = idle.pop()
                if now - c.idle_since < self.max_idle:
                    c.reused = True
                    return c
                sockio.close(c.sock)
        sem = self._dialing.get(key)
        if sem is None:
            sem = self._dialing[key] = trio.Semaphore(self.max_connecting)
        try:
            async with sem:
                sock = await self._dial(host, port)
        finally:
            if sem.value == self.max_connecting and not sem.statistics().tasks_waiting:
                self._dialing.pop(key, None)
        self.opened += 1
        return UpstreamConn(sock, key)

    async def _dial(self, host: str, port: int) -> socket.socket:
        start = trio.current_time()
        try:
            infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ConnectFailed(f"connect to {host}:{port}: {exc.strerror or exc}") from exc
        if not infos:
            raise ConnectFailed(f"connect to {host}:{port}: no address")
        family, type_, proto, _, addr = infos[0]
        sock = socket.socket(family, type_, proto)
        ok = False
        try:
            sock.setblocking(False)
            try:
                sock.connect(addr)
                pending = False
            except BlockingIOError:
                pending = True
            except OSError as exc:
                raise ConnectFailed(f"connect to {host}:{port}: {exc.strerror or exc}") from exc
            timeout = self.connect_timeout
            deadline = start + timeout
            while pending:
                with trio.move_on_at(deadline) as scope:
                    await wait_writable(sock)
                if not scope.cancelled_caught:
                    break
                now = trio.current_time()
                late = self.lag.late_between(start, now) if self.lag is not None else 0.0
                if start + timeout + late <= now + 1e-3:
                    raise ConnectFailed(f"connect to {host}:{port} timed out ({timeout:g}s"
                                        + (f", {late:.3g}s of it the router's own lateness" if late else "")
                                        + ")")
                deadline = start + timeout + late  # the engine is owed the time we were away
                self.forgiven += 1
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise ConnectFailed(f"connect to {host}:{port}: {os.strerror(err)}")
            sockio.set_nodelay(sock)
            ok = True
            return sock
        finally:
            if not ok:
                sockio.close(sock)

    def release(self, c: UpstreamConn) -> None:
        """Back to the pool if the exchange finished cleanly; closed otherwise."""
        if c.clean:
            idle = self._idle.setdefault(c.key, [])
            if len(idle) < self.max_idle_per_host:
                c.idle_since = trio.current_time()
                idle.append(c)
                return
        close_now(c)

    def drop_host(self, host: str, port: int) -> None:
        for c in self._idle.pop((host, port), []):
            close_now(c)

    def close_all(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                close_now(c)
        self._idle.clear()


def close_now(c: UpstreamConn) -> None:
    """Close without awaiting (safe inside a cancelled scope): the engine sees EOF."""
    sockio.close(c.sock)


async def fetch_text(pool: UpstreamPool, host: str, port: int, path: bytes, timeout: float,
                     auth: bytes = b"") -> str:
    """GET a small text resource (/metrics, /health) over the pool; `auth`: the engine's
    key as a header line (Replica.auth)."""
    with trio.fail_after(timeout):
        c = await pool.acquire(host, port)
        try:
            await c.send_request(
                b"GET %s HTTP/1.1\r\nhost: %s:%d\r\naccept: */*\r\n%s\r\n"
                % (path, host.encode(), port, auth),
                b"",
            )
            head = await c.read_head()
            body = await c.read_body()
        except ProtocolError as exc:
            c.clean = False
            raise ValueError(str(exc)) from exc
        finally:
            pool.release(c)
        if head.status != 200:
            raise ValueError(f"HTTP {head.status}")
        return body.decode("utf-8", "replace")

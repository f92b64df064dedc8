"""Pooled keep-alive HTTP/1.1 connections to engines, and the relay of one answer.

The engine's answers are read by the sans-IO parsers of `llmgw.http1` (ResponseParser:
the head, 1xx skipped, and small whole bodies; ChunkedReader: a relayed body's framing);
this module only does the I/O. The body of a relayed answer is forwarded as the raw
bytes that arrived (chunk framing checked, not rewritten), so a streamed event costs one
receive and one send (see bench/README.md for the figures).

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
from collections.abc import Callable

import trio
from trio.lowlevel import wait_writable

from llmgw.config.router import RouterConfig
from llmgw.http1.chunked import ChunkedReader
from llmgw.http1.grammar import H1Error
from llmgw.http1.request import Request
from llmgw.http1.response import ResponseHead, ResponseParser
from llmgw.http1.writers import BodyWriter, ChunkedWriter, CloseWriter
from llmgw.router.connection import sockio
from llmgw.router.connection.http import ClientConn
from llmgw.router.connection.lag import LagMeter
from llmgw.router.errors import sse_error_event
from llmgw.router.metrics import RouterMetrics
from llmgw.router.routing.balancer import Replica
from llmgw.router.tenants.usage import UsageTap


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


class ClientGone(Exception):
    """The client closed its connection while its request was being served."""


class Failed(Exception):
    """An attempt on one replica failed before anything went to the client."""

    def __init__(self, message: str, *, eject: bool = True, retry: bool = True) -> None:
        super().__init__(message)
        self.eject = eject
        self.retry = retry


RETRY_STATUS = (502, 503, 504)


class Relay:
    """One request to one replica, its answer relayed to the client as it arrives."""

    def __init__(
        self,
        pool: UpstreamPool,
        config: RouterConfig,
        metrics: RouterMetrics,
        eject: Callable[[str, Replica, str], None],
    ) -> None:
        self.pool = pool
        self.first_byte = config.first_byte_timeout
        self.idle = config.idle_timeout
        self.metrics = metrics
        self.eject = eject

    async def _head(self, r: Replica, req_head: bytes, body: bytes) -> tuple[UpstreamConn, Head]:
        fresh = False
        while True:
            try:
                conn = await self.pool.acquire(r.host, r.port, fresh=fresh)
            except ConnectFailed as exc:
                self.metrics.upstream_error(r.replica_id, "connect")
                raise Failed(str(exc)) from None
            ok = False
            try:
                await conn.send_request(req_head, body)
                head = await conn.read_head()
                ok = True
                return conn, head
            except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError) as exc:
                if conn.reused and not fresh:
                    fresh = True  # the engine closed an idle connection: dial a new one
                    continue
                self.metrics.upstream_error(r.replica_id, "broken")
                raise Failed(f"connection lost before the response: {exc}") from None
            finally:
                if not ok:
                    close_now(conn)

    async def run(
        self,
        client: ClientConn,
        req: Request,
        path: bytes,
        r: Replica,
        streaming: bool,
        model: str,
        t0: float | None = None,
        tap: UsageTap | None = None,
        body: bytes | None = None,
    ) -> int:
        """Relay one exchange; returns the status. Raises Failed before anything went to
        the client, trio.BrokenResourceError when the engine failed after that, ClientGone
        when the client closed meanwhile (the engine's connection is closed: it stops).
        `t0`: the clock now, when the caller has just read it. `tap` (usage metering,
        issue 24) sees the answer and may drop a stream's usage event; `body` replaces
        the client's (a metered stream asks the engine for its usage)."""
        if t0 is None:
            t0 = trio.current_time()
        http10 = client.http10  # no chunked framing for the client: ask the engine in 1.0
        if body is None:
            body = req.body
        # The engine's own key (r.auth), never the client's Authorization: that is
        # llmgw's tenant key, which no engine has any business seeing.
        req_head = (
            b"POST %s HTTP/1.%d\r\nhost: %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
            % (
                path,
                0 if http10 else 1,
                r.authority,
                len(body),
                r.auth,
            )
        )
        conn: UpstreamConn | None = None
        ok = False
        broken = ""
        out = b""
        writer: BodyWriter | None = None  # what the router frames itself (none for a length)
        extra = False
        scanner: ChunkedReader | None = None
        send = client.sock
        # One cancel scope for the whole exchange: the first-byte deadline until the head
        # is in, then the idle deadline, pushed forward as data comes (only when it moved by
        # more than 1/64 of the idle timeout, so not on every event: a stall ends the
        # exchange after between 63/64 and 64/64 of `idle_timeout`). The client's reader
        # cancels it too when the client closes (`client.watch`).
        try:
            with trio.CancelScope(deadline=t0 + self.first_byte) as scope:
                client.watch = scope
                if client.eof:
                    scope.cancel()
                conn, head = await self._head(r, req_head, body)
                status = head.status
                if status in RETRY_STATUS:
                    self.metrics.upstream_error(r.replica_id, "status")
                    raise Failed(f"engine answered HTTP {status}")
                if status == 401 and r.auth:
                    # The engine refused the key the table gave for it (it restarted with a
                    # new one this router has not polled yet): the engine's fault, never the
                    # client's, whose own key the router already accepted. Another replica.
                    self.metrics.upstream_error(r.replica_id, "status")
                    raise Failed("engine refused the key the endpoint table gave for it (HTTP 401)")
                now = trio.current_time()
                r.last_ok = now  # evidence for the balancer: this replica answers
                r.fails = 0
                self.metrics.first_byte(model, now - t0)
                idle = self.idle
                slack = idle / 64
                # The idle deadline replaces the first-byte one before the first wait
                # from here on: an answer that came whole with its head (the usual plain
                # one) and goes out at once needs no deadline change (a few µs of trio).
                idle_armed = False
                framing = head.framing
                if framing == "chunked":
                    if http10:
                        raise H1Error(502, "chunked answer to an HTTP/1.0 request")
                    scanner = ChunkedReader(502)
                    writer = ChunkedWriter()  # its end only: the chunks are the engine's
                    if tap is not None:
                        tap.chunked = True
                    out = client.head(
                        status, b"content-type: %s\r\ntransfer-encoding: chunked\r\n" % head.content_type
                    )
                elif framing == "length":
                    out = client.head(
                        status,
                        b"content-type: %s\r\ncontent-length: %d\r\n" % (head.content_type, head.length),
                    )
                elif http10:
                    client.keep_alive = False
                    writer = CloseWriter()
                    out = client.head(status, b"content-type: %s\r\n" % head.content_type)
                else:
                    writer = ChunkedWriter()  # an answer that ends with the connection, chunked
                    out = client.head(
                        status, b"content-type: %s\r\ntransfer-encoding: chunked\r\n" % head.content_type
                    )
                left = head.length
                upstream = conn.sock
                data = conn.parser.take()
                while True:
                    if data:
                        if scanner is not None:
                            # The engine's chunks go to the client byte for byte.
                            fwd, done = scanner.feed(data)
                            out += fwd if tap is None else tap.feed(fwd)
                        elif framing == "length":
                            if len(data) > left:
                                data = data[:left]
                                extra = True  # more than the engine said: not reused
                            left -= len(data)
                            out += data if tap is None else tap.feed(data)
                            done = left == 0
                        else:
                            if tap is not None:
                                tap.feed(data)
                            assert writer is not None
                            out += writer.data(data)
                            done = False
                        if done:
                            if tap is not None:
                                tap.done()
                            if writer is not None:
                                out += writer.end()
                            if idle_armed:
                                await sockio.send_all(send, out)
                            else:
                                sent = sockio.send_now(send, out)
                                if sent < len(out):
                                    scope.deadline = trio.current_time() + idle
                                    await sockio.send_all(send, out[sent:])
                            ok = True
                            conn.clean = head.keep_alive and not extra
                            if scanner is not None and scanner.extra:
                                conn.clean = False
                            return status
                    if not idle_armed:
                        idle_armed = True
                        scope.deadline = trio.current_time() + idle
                    if out:
                        await sockio.send_all(send, out)
                        out = b""
                    try:
                        data = await sockio.recv(upstream)
                    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                        broken = f"connection lost: {exc}"
                        break
                    if not data:
                        if framing == "close":
                            if tap is not None:
                                tap.done()
                            assert writer is not None
                            if end := writer.end():
                                await sockio.send_all(send, end)
                            ok = True
                            return status
                        broken = "engine closed the connection mid-response"
                        break
                    now = trio.current_time()
                    if now + idle > scope.deadline + slack:
                        scope.deadline = now + idle
            if scope.cancelled_caught:
                if client.eof:
                    raise ClientGone()
                if conn is None:
                    self.metrics.upstream_error(r.replica_id, "timeout")
                    raise Failed(f"no response within {self.first_byte:g}s", eject=False, retry=False)
                broken = f"no data for {self.idle:g}s"
        except ProtocolError as exc:
            if not client.responded:
                self.metrics.upstream_error(r.replica_id, "broken")
                raise Failed(f"engine broke the response: {exc}") from None
            broken = f"engine broke the response: {exc}"
        finally:
            client.watch = None
            if conn is not None:
                if ok:
                    self.pool.release(conn)
                else:
                    close_now(conn)
        # The engine failed after the client got the head: end the stream with an error.
        self.metrics.upstream_error(r.replica_id, "broken")
        if not broken.startswith("no data"):
            self.eject(model, r, broken)
        at_boundary = scanner is None or (scanner.remaining == 0 and not scanner.partial)
        # The error event goes as a chunk of its own, and only where a chunk may begin.
        if streaming and isinstance(writer, ChunkedWriter) and not writer.ended and at_boundary:
            ev = sse_error_event(f"replica {r.replica_id} failed: {broken}")
            out += writer.data(ev) + writer.end()
            await sockio.send_all(send, out)
            return status
        if out:
            await sockio.send_all(send, out)
        raise trio.BrokenResourceError(f"engine failed mid-response: {broken}")

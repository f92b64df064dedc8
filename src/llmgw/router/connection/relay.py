"""The relay of one answer: one request to one replica, its answer passed to the client as
it arrives.

The engine's head is read by `llmgw.http1.response.ResponseParser` (through the pooled
connection, `upstream.UpstreamConn`). The body of a relayed answer is forwarded as the raw
bytes that arrived (chunk framing checked by `ChunkedReader`, not rewritten), so a
streamed event costs one receive and one send (see bench/README.md for the figures). What
the router frames itself (a close-delimited answer chunked for an HTTP/1.1 client, the end
of the body, a failed stream's error event) goes through `llmgw.http1.writers`.

`Relay.run` is four steps: the request and the engine's head (`_head`, `_answered`), the
client's head and the answer's framing (`_answer`), the body (`_relay_body`), and, when
the engine fails after the client got the head, the end of the stream (`_broke`), or
`Migrate` where the stream may go on on another replica (mid-stream failover: the
exchange's `follow`, resume.py; the replica is chosen by failover.py). A continuation is
relayed by the same steps into the same client response: no head of its own.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from llmgw.config.router import RouterConfig
from llmgw.http1.chunked import ChunkedReader
from llmgw.http1.grammar import H1Error
from llmgw.http1.writers import LAST_CHUNK, BodyWriter, ChunkedWriter, CloseWriter, chunk
from llmgw.router.connection import sockio
from llmgw.router.connection.upstream import (
    ConnectFailed,
    Head,
    ProtocolError,
    UpstreamConn,
    UpstreamPool,
    close_now,
)
from llmgw.router.errors import sse_error_event
from llmgw.router.exchange import Exchange
from llmgw.router.metrics import RouterMetrics
from llmgw.router.routing.balancer import Replica


class ClientGone(Exception):
    """The client closed its connection while its request was being served."""


class Failed(Exception):
    """An attempt on one replica failed before anything went to the client."""

    def __init__(self, message: str, *, eject: bool = True, retry: bool = True) -> None:
        super().__init__(message)
        self.eject = eject
        self.retry = retry


class Migrate(Exception):
    """The engine failed after the client got part of a stream that may go on on another
    replica (what was sent is whole events; the exchange's `follow` knows them)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


RETRY_STATUS = (502, 503, 504)


class _Answer:
    """What the relay of one answer keeps between its steps: the engine's head, the bytes
    not yet sent to the client, how the router frames what it writes itself (None when
    the engine's Content-Length carries the body), the reader of the engine's chunks, and
    whether the engine sent more than it said."""

    __slots__ = ("head", "out", "writer", "scanner", "extra")

    def __init__(self, head: Head, out: bytes, writer: BodyWriter | None,
                 scanner: ChunkedReader | None) -> None:
        self.head = head
        self.out = out
        self.writer = writer
        self.scanner = scanner
        self.extra = False


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

    async def run(self, ex: Exchange, r: Replica, t0: float | None = None,
                  deadline: float | None = None) -> int:
        """Relay one exchange; returns the status. Raises Failed before anything went to
        the client (or, for a continuation, before the continuation's head),
        trio.BrokenResourceError when the engine failed after that, Migrate when the
        stream may go on elsewhere, ClientGone when the client closed meanwhile (the
        engine's connection is closed: it stops). `t0`: the clock now, when the caller has
        just read it. `deadline`: for the engine's head, instead of `first_byte_timeout`
        from `t0`. The exchange's `tap` (usage metering) sees the answer and may drop a
        stream's usage event; its `body` replaces the client's (a metered stream asks the
        engine for its usage; a continuation is its own request)."""
        if t0 is None:
            t0 = trio.current_time()
        if deadline is None:
            deadline = t0 + self.first_byte
        client = ex.client
        req_head, body = self._request(ex, r)
        conn: UpstreamConn | None = None
        a: _Answer | None = None
        ok = False
        broken = ""
        # One cancel scope for the whole exchange: the first-byte deadline until the head
        # is in, then the idle deadline, pushed forward as data comes (only when it moved by
        # more than 1/64 of the idle timeout, so not on every event: a stall ends the
        # exchange after between 63/64 and 64/64 of `idle_timeout`). The client's reader
        # cancels it too when the client closes (`client.watch`).
        try:
            with trio.CancelScope(deadline=deadline) as scope:
                client.watch = scope
                if client.eof:
                    scope.cancel()
                conn, head = await self._head(r, req_head, body)
                self._answered(r, head, ex.model, t0)
                a = self._answer(ex, head)
                why = await self._relay_body(ex, conn, a, scope)
                if why is None:
                    ok = True
                    return head.status
                broken = why
            if scope.cancelled_caught:
                if client.eof:
                    raise ClientGone()
                if conn is None:
                    self.metrics.upstream_error(r.replica_id, "timeout")
                    raise Failed(f"no response within {deadline - t0:g}s", eject=False, retry=False)
                broken = f"no data for {self.idle:g}s"
        except ProtocolError as exc:
            if a is None:
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
        assert a is not None  # the client got a head: the answer's framing was chosen
        follow = ex.follow
        if follow is not None and follow.at_edge:
            self.metrics.upstream_error(r.replica_id, "broken")
            if not broken.startswith("no data"):
                self.eject(ex.model, r, broken)
            if a.out:  # whole chunks only: the follower holds a partial one back
                await sockio.send_all(client.sock, a.out)
            raise Migrate(f"replica {r.replica_id} failed: {broken}")
        return await self._broke(ex, r, a, broken)

    @staticmethod
    async def end_stream(ex: Exchange, why: str, whole: bool = False) -> None:
        """End a stream that went through a failover and can go on no further: the error
        event (`why`), or only [DONE] when the client already had the whole answer
        (`whole`: its finish_reason went out, the engine broke before its end)."""
        ev = b"data: [DONE]\n\n" if whole else sse_error_event(why)
        await sockio.send_all(ex.client.sock, chunk(ev) + LAST_CHUNK)

    @staticmethod
    def _request(ex: Exchange, r: Replica) -> tuple[bytes, bytes]:
        """The request's head and body for the engine. The engine's own key (r.auth), never
        the client's Authorization: that is llmgw's tenant key, which no engine has any
        business seeing. An HTTP/1.0 client gets no chunked framing: the engine is asked in
        1.0 too."""
        body = ex.req.body if ex.body is None else ex.body
        head = (
            b"POST %s HTTP/1.%d\r\nhost: %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
            % (ex.path, 0 if ex.client.http10 else 1, r.authority, len(body), r.auth)
        )
        return head, body

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

    def _answered(self, r: Replica, head: Head, model: str, t0: float) -> None:
        """The engine's head is in: a status to try elsewhere raises Failed; else the
        replica answers, which the balancer counts as evidence."""
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
        r.last_ok = now
        r.fails = 0
        self.metrics.first_byte(model, now - t0)

    @staticmethod
    def _answer(ex: Exchange, head: Head) -> _Answer:
        """The client's head, and how the body goes on: the engine's chunks byte for byte,
        its Content-Length, or (an answer that ends with the connection) chunked by the
        router for an HTTP/1.1 client and close-delimited for an HTTP/1.0 one. A
        continuation writes no head: its chunks go on in the client's response, which only
        a 200 with chunks can do."""
        client = ex.client
        status = head.status
        framing = head.framing
        follow = ex.follow
        if follow is not None:
            if follow.stream.part:
                if status != 200 or framing != "chunked":
                    raise Failed(f"the continuation was answered HTTP {status} ({framing})",
                                 eject=False, retry=False)
                return _Answer(head, b"", ChunkedWriter(), ChunkedReader(502))
            if status != 200 or framing != "chunked":
                ex.follow = None  # only an engine's chunked stream is followed
        chunked_head = b"content-type: %s\r\ntransfer-encoding: chunked\r\n" % head.content_type
        if framing == "chunked":
            if client.http10:
                raise H1Error(502, "chunked answer to an HTTP/1.0 request")
            if ex.tap is not None:
                ex.tap.chunked = True
            # The writer's end only: the chunks are the engine's.
            return _Answer(head, client.head(status, chunked_head), ChunkedWriter(), ChunkedReader(502))
        if framing == "length":
            out = client.head(
                status, b"content-type: %s\r\ncontent-length: %d\r\n" % (head.content_type, head.length)
            )
            return _Answer(head, out, None, None)
        if client.http10:
            client.keep_alive = False
            return _Answer(head, client.head(status, b"content-type: %s\r\n" % head.content_type),
                           CloseWriter(), None)
        return _Answer(head, client.head(status, chunked_head), ChunkedWriter(), None)

    async def _relay_body(self, ex: Exchange, conn: UpstreamConn, a: _Answer,
                          scope: trio.CancelScope) -> str | None:
        """The body, from the engine to the client as it comes. None when it ended well
        (the connection marked clean if it may carry another exchange), else why it broke;
        the bytes not sent yet stay in `a.out`."""
        tap = ex.tap
        follow = ex.follow
        send = ex.client.sock
        head = a.head
        framing = head.framing
        scanner = a.scanner
        writer = a.writer
        idle = self.idle
        slack = idle / 64
        # The idle deadline replaces the first-byte one before the first wait from here
        # on: an answer that came whole with its head (the usual plain one) and goes out at
        # once needs no deadline change (a few µs of trio).
        idle_armed = False
        left = head.length
        upstream = conn.sock
        data = conn.parser.take()
        while True:
            if data:
                if scanner is not None:
                    # The engine's chunks go to the client byte for byte.
                    fwd, done = scanner.feed(data)
                    if follow is not None:
                        fwd = follow.feed(fwd)
                    a.out += fwd if tap is None else tap.feed(fwd)
                elif framing == "length":
                    if len(data) > left:
                        data = data[:left]
                        a.extra = True  # more than the engine said: not reused
                    left -= len(data)
                    a.out += data if tap is None else tap.feed(data)
                    done = left == 0
                else:
                    if tap is not None:
                        tap.feed(data)
                    assert writer is not None
                    a.out += writer.data(data)
                    done = False
                if done:
                    if tap is not None:
                        tap.done()
                    if writer is not None:
                        a.out += writer.end()
                    out = a.out
                    if idle_armed:
                        await sockio.send_all(send, out)
                    else:
                        sent = sockio.send_now(send, out)
                        if sent < len(out):
                            scope.deadline = trio.current_time() + idle
                            await sockio.send_all(send, out[sent:])
                    conn.clean = head.keep_alive and not a.extra
                    if scanner is not None and scanner.extra:
                        conn.clean = False
                    return None
            if not idle_armed:
                idle_armed = True
                scope.deadline = trio.current_time() + idle
            if a.out:
                await sockio.send_all(send, a.out)
                a.out = b""
            try:
                data = await sockio.recv(upstream)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                return f"connection lost: {exc}"
            if not data:
                if framing == "close":
                    if tap is not None:
                        tap.done()
                    assert writer is not None
                    if end := writer.end():
                        await sockio.send_all(send, end)
                    return None
                return "engine closed the connection mid-response"
            now = trio.current_time()
            if now + idle > scope.deadline + slack:
                scope.deadline = now + idle

    async def _broke(self, ex: Exchange, r: Replica, a: _Answer, broken: str) -> int:
        """The engine failed after the client got the head: a stream ends with an error
        event where a chunk may begin (then the status is returned); anything else raises
        trio.BrokenResourceError once what was received is sent."""
        self.metrics.upstream_error(r.replica_id, "broken")
        if not broken.startswith("no data"):
            self.eject(ex.model, r, broken)
        scanner = a.scanner
        writer = a.writer
        at_boundary = scanner is None or (scanner.remaining == 0 and not scanner.partial)
        send = ex.client.sock
        # The error event goes as a chunk of its own, never after the body's end.
        if ex.streaming and isinstance(writer, ChunkedWriter) and not writer.ended and at_boundary:
            ev = sse_error_event(f"replica {r.replica_id} failed: {broken}")
            await sockio.send_all(send, a.out + writer.data(ev) + writer.end())
            return a.head.status
        if a.out:
            await sockio.send_all(send, a.out)
        raise trio.BrokenResourceError(f"engine failed mid-response: {broken}")

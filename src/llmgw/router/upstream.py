"""Pooled keep-alive HTTP/1.1 connections to engines: h11 client side over trio.

`UpstreamPool.acquire` hands out an idle connection to (host, port) or dials a new one
(TCP_NODELAY, bounded by the connect timeout). A connection goes back to the pool only
when both sides finished the exchange cleanly; anything else (a client that went away
mid-stream, a timeout, an error) closes it, which is how the engine learns to stop
generating. Idle connections older than `max_idle` are dropped rather than reused, since
engines close theirs after a few seconds of quiet.
"""

from __future__ import annotations

from collections.abc import Callable

import h11
import trio

from llmgw.config.router import RouterConfig
from llmgw.router.balancer import Replica
from llmgw.router.errors import sse_error_event
from llmgw.router.http import RECV, ClientConn, Request, set_nodelay
from llmgw.router.metrics import RouterMetrics


class ConnectFailed(OSError):
    """Refused, unreachable or too slow to connect: eject the replica and try another."""


class UpstreamConn:
    __slots__ = ("stream", "h11", "key", "reused", "idle_since")

    def __init__(self, stream: trio.SocketStream, key: tuple[str, int]) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=65536)
        self.key = key
        self.reused = False
        self.idle_since = 0.0

    async def send_request(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        conn = self.h11
        out = conn.send(h11.Request(method=method, target=target, headers=headers)) or b""
        if body:
            out += conn.send(h11.Data(data=body)) or b""
        out += conn.send(h11.EndOfMessage()) or b""
        await self.stream.send_all(out)

    async def next_event(self) -> h11.Event:
        """The next response event. EOF or a garbled answer raises h11.RemoteProtocolError."""
        conn = self.h11
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                conn.receive_data(await self.stream.receive_some(RECV))
                continue
            assert not isinstance(ev, type)  # PAUSED cannot happen on the client side here
            return ev

    def reusable(self) -> bool:
        return self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE


class UpstreamPool:
    def __init__(self, connect_timeout: float, max_idle: float = 3.0, max_idle_per_host: int = 512) -> None:
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[tuple[str, int], list[UpstreamConn]] = {}
        self.opened = 0  # new connections dialled, for the metrics

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
                c.stream.socket.close()
        try:
            with trio.fail_after(self.connect_timeout):
                stream = await trio.open_tcp_stream(host, port)
        except trio.TooSlowError as exc:
            raise ConnectFailed(f"connect to {host}:{port} timed out") from exc
        except OSError as exc:
            raise ConnectFailed(f"connect to {host}:{port}: {exc.strerror or exc}") from exc
        set_nodelay(stream)
        self.opened += 1
        return UpstreamConn(stream, key)

    def release(self, c: UpstreamConn) -> None:
        """Back to the pool if the exchange finished cleanly; closed otherwise."""
        if c.reusable():
            c.h11.start_next_cycle()
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
    try:
        c.stream.socket.close()
    except OSError:
        pass


async def fetch_text(pool: UpstreamPool, host: str, port: int, path: bytes, timeout: float) -> str:
    """GET a small text resource (/metrics, /health) over the pool."""
    with trio.fail_after(timeout):
        c = await pool.acquire(host, port)
        ok = False
        try:
            await c.send_request(
                b"GET", path, [(b"host", f"{host}:{port}".encode()), (b"accept", b"*/*")], b""
            )
            ev = await c.next_event()
            if not isinstance(ev, h11.Response):
                raise ValueError(f"unexpected {type(ev).__name__}")
            parts: list[bytes] = []
            while True:
                b = await c.next_event()
                if isinstance(b, h11.Data):
                    parts.append(bytes(b.data))
                elif isinstance(b, h11.EndOfMessage):
                    break
                else:
                    raise ValueError("connection closed mid-body")
            if ev.status_code != 200:
                raise ValueError(f"HTTP {ev.status_code}")
            ok = True
            return b"".join(parts).decode("utf-8", "replace")
        except h11.ProtocolError as exc:
            raise ValueError(str(exc)) from exc
        finally:
            if ok:
                pool.release(c)
            else:
                close_now(c)


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
        eject: Callable[[Replica, str], None],
    ) -> None:
        self.pool = pool
        self.first_byte = config.first_byte_timeout
        self.idle = config.idle_timeout
        self.metrics = metrics
        self.eject = eject

    async def _head(self, r: Replica, path: bytes, body: bytes) -> tuple[UpstreamConn, h11.Response]:
        headers = [
            (b"host", r.authority),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        fresh = False
        while True:
            try:
                conn = await self.pool.acquire(r.host, r.port, fresh=fresh)
            except ConnectFailed as exc:
                self.metrics.upstream_errors.labels(r.replica_id, "connect").inc()
                raise Failed(str(exc)) from None
            try:
                await conn.send_request(b"POST", path, headers, body)
                with trio.fail_after(self.first_byte):
                    ev = await conn.next_event()
                    while isinstance(ev, h11.InformationalResponse):
                        ev = await conn.next_event()
            except trio.TooSlowError:
                close_now(conn)
                self.metrics.upstream_errors.labels(r.replica_id, "timeout").inc()
                raise Failed(f"no response within {self.first_byte:g}s", eject=False, retry=False) from None
            except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError) as exc:
                close_now(conn)
                if conn.reused and not fresh:
                    fresh = True  # the engine closed an idle connection: dial a new one
                    continue
                self.metrics.upstream_errors.labels(r.replica_id, "broken").inc()
                raise Failed(f"connection lost before the response: {exc}") from None
            if not isinstance(ev, h11.Response):
                close_now(conn)
                raise Failed(f"unexpected {type(ev).__name__} from the engine")
            return conn, ev

    async def run(
        self,
        client: ClientConn,
        req: Request,
        path: bytes,
        r: Replica,
        streaming: bool,
        model: str,
    ) -> int:
        t0 = trio.current_time()
        conn, resp = await self._head(r, path, req.body)
        status = resp.status_code
        if status in RETRY_STATUS:
            close_now(conn)
            self.metrics.upstream_errors.labels(r.replica_id, "status").inc()
            raise Failed(f"engine answered HTTP {status}")
        self.metrics.timers(model)[1].observe(trio.current_time() - t0)
        ctype = b"application/json"
        clen = None
        for k, v in resp.headers:
            if k == b"content-type":
                ctype = v
            elif k == b"content-length":
                clen = v
        hdrs = [(b"content-type", ctype)]
        if clen is not None:
            hdrs.append((b"content-length", clen))
        out = client.start_response(status, hdrs)
        h = conn.h11
        upstream = conn.stream
        send = client.stream.send_all
        ok = False
        first = True
        broken = ""
        try:
            with trio.CancelScope() as scope:
                while True:
                    ev = h.next_event()
                    if ev is h11.NEED_DATA:
                        if out:
                            await send(out)
                            out = b""
                        scope.deadline = trio.current_time() + (self.first_byte if first else self.idle)
                        try:
                            data = await upstream.receive_some(RECV)
                        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                            broken = f"connection lost: {exc}"
                            break
                        first = False
                        h.receive_data(data)
                        continue
                    if type(ev) is h11.Data:
                        out += client.data(ev.data)
                    elif type(ev) is h11.EndOfMessage:
                        out += client.end()
                        await send(out)
                        ok = True
                        return status
                    else:
                        broken = "connection closed mid-response"
                        break
            if scope.cancelled_caught:
                broken = f"no data for {self.idle:g}s"
        except h11.RemoteProtocolError as exc:
            broken = f"engine broke the response: {exc}"
        finally:
            if ok:
                self.pool.release(conn)
            else:
                close_now(conn)
        # The engine failed after the client got the head: end the stream with an error.
        self.metrics.upstream_errors.labels(r.replica_id, "broken").inc()
        if not broken.startswith("no data"):
            self.eject(r, broken)
        if streaming and clen is None and client.h11.our_state is h11.SEND_BODY:
            out += client.data(sse_error_event(f"replica {r.replica_id} failed: {broken}"))
            out += client.end()
            await send(out)
            return status
        if out:
            await send(out)
        raise trio.BrokenResourceError(f"engine failed mid-response: {broken}")

"""A small HTTP/1.1 server over trio and h11: keep-alive, chunked streaming, and
noticing a client that goes away in the middle of a response."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import trio

log = logging.getLogger("llmgw.simengine")

MAX_BODY = 16 * 1024 * 1024
_RECV = 65536


class ClientGone(Exception):
    """The client closed its connection while we were answering."""


# What a client that went away looks like from here: our ClientGone (a write failed), or
# trio's own errors from a receive or send the handler made on the stream directly.
_GONE = (ClientGone, trio.BrokenResourceError, trio.ClosedResourceError)


class Exchange:
    """One request and the means to answer it."""

    def __init__(
        self, stream: trio.SocketStream, conn: h11.Connection, request: h11.Request, body: bytes
    ) -> None:
        self._stream = stream
        self._conn = conn
        self.method = request.method.decode("ascii", "replace").upper()
        self.target = request.target.decode("ascii", "replace")
        self.path = self.target.split("?", 1)[0]
        self.headers = {k.decode().lower(): v.decode("latin-1") for k, v in request.headers}
        self.body = body
        self.request_id: str | None = None  # set by the handler, for the log
        self.responded = False

    async def _send(self, event: Any) -> None:
        data = self._conn.send(event)
        if data:
            try:
                await self._stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ClientGone() from exc

    async def start(self, status: int, content_type: str, length: int | None = None) -> None:
        headers = [("content-type", content_type), ("server", "llmgw-simengine")]
        if length is not None:
            headers.append(("content-length", str(length)))
        self.responded = True
        await self._send(h11.Response(status_code=status, headers=headers))

    async def send_body(self, data: bytes) -> None:
        await self._send(h11.Data(data=data))

    async def end(self) -> None:
        await self._send(h11.EndOfMessage())

    async def send_bytes(self, status: int, content_type: str, data: bytes) -> None:
        await self.start(status, content_type, len(data))
        if data:
            await self.send_body(data)
        await self.end()

    async def send_json(self, status: int, obj: Any) -> None:
        await self.send_bytes(status, "application/json", json.dumps(obj).encode())


Handler = Callable[[Exchange], Awaitable[None]]


async def _next_event(stream: trio.SocketStream, conn: h11.Connection) -> Any:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        data = await stream.receive_some(_RECV)
        conn.receive_data(data)  # b"" marks the peer's end of stream


async def _watch_eof(
    stream: trio.SocketStream, conn: h11.Connection, scope: trio.CancelScope
) -> None:
    """Cancel the handler when the client closes; keep any pipelined bytes for h11."""
    while True:
        try:
            data = await stream.receive_some(_RECV)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        conn.receive_data(data)  # b"" marks the end: the next cycle sees ConnectionClosed
        if not data:
            scope.cancel()
            return


async def _run_handler(
    handler: Handler, stream: trio.SocketStream, conn: h11.Connection, ex: Exchange
) -> bool:
    """Run one handler; False when the client went away before it finished.

    The handler runs inside a nursery (beside the EOF watcher), so a ClientGone it raises
    (a write that met EPIPE or a reset: a router's /metrics fetch that timed out and
    closed) comes out wrapped in an ExceptionGroup: `except*` takes it out of the group
    wherever it sits. Anything else the handler raises is left to propagate."""
    completed = False
    try:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_eof, stream, conn, scope)
                await handler(ex)
                completed = True
                nursery.cancel_scope.cancel()
    except* _GONE as group:
        log.debug("client gone while answering: %r", group.exceptions[0])
        completed = False
    if not completed:
        what = f"request {ex.request_id}" if ex.request_id else f"{ex.method} {ex.path}"
        log.info("%s cancelled by client", what)
    return completed


async def serve_connection(stream: trio.SocketStream, handler: Handler) -> None:
    """Serve requests on one connection until either side closes it."""
    try:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
    except OSError as exc:
        log.debug("TCP_NODELAY not set: %s", exc)
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_BODY)
    try:
        while True:
            try:
                event = await _next_event(stream, conn)
                if not isinstance(event, h11.Request):
                    return  # ConnectionClosed, or a peer that sent nothing more
                body = bytearray()
                while True:
                    part = await _next_event(stream, conn)
                    if isinstance(part, h11.Data):
                        body += part.data
                        if len(body) > MAX_BODY:
                            raise h11.RemoteProtocolError("body too large", 413)
                    elif isinstance(part, h11.EndOfMessage):
                        break
                    else:
                        return
            except h11.RemoteProtocolError as exc:
                log.info("bad HTTP request: %s", exc)
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    await _send_error(stream, conn, exc.error_status_hint, str(exc))
                return
            ex = Exchange(stream, conn, event, bytes(body))
            if not await _run_handler(handler, stream, conn, ex):
                return
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is not h11.DONE:
                return
            if conn.our_state is not h11.DONE:
                log.warning("handler for %s %s left its response unfinished", ex.method, ex.path)
                return
            conn.start_next_cycle()
    except (trio.BrokenResourceError, trio.ClosedResourceError, ClientGone) as exc:
        log.debug("connection dropped: %r", exc)
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


async def _send_error(
    stream: trio.SocketStream, conn: h11.Connection, status: int, message: str
) -> None:
    body = json.dumps(_error(message, status)).encode()
    headers = [
        ("content-type", "application/json"),
        ("content-length", str(len(body))),
        ("connection", "close"),
    ]
    try:
        data = conn.send(h11.Response(status_code=status, headers=headers)) or b""
        data += (conn.send(h11.Data(data=body)) or b"") + (conn.send(h11.EndOfMessage()) or b"")
    except h11.LocalProtocolError as exc:
        log.info("could not answer a bad request: %s", exc)
        return
    await stream.send_all(data)


def _error(message: str, status: int, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def error_body(message: str, status: int, kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error shape."""
    return _error(message, status, kind)

"""A small HTTP/1.1 server over trio and llmgw.http1's request parser: keep-alive,
chunked streaming, and noticing a client that goes away in the middle of a response.

Requests are read by `llmgw.http1.request.RequestParser` (the router's own rules, so the
simulated engine is as strict as what stands in front of it); answers are framed by
`llmgw.http1.writers`: Content-Length when the length is known, else chunked
(close-delimited for HTTP/1.0), `connection: close` when the client asked for it.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import trio

from llmgw.http1.grammar import H1Error
from llmgw.http1.request import Request, RequestParser
from llmgw.http1.writers import BodyWriter, ChunkedWriter, CloseWriter, LengthWriter

# JSON as vLLM's server writes it (Starlette's JSONResponse and pydantic): no spaces.
COMPACT = (",", ":")

log = logging.getLogger("llmgw.simengine")

MAX_BODY = 16 * 1024 * 1024
_RECV = 65536
_REASON = {int(s): s.phrase for s in HTTPStatus}


class ClientGone(Exception):
    """The client closed its connection while we were answering."""


# What a client that went away looks like from here: our ClientGone (a write failed), or
# trio's own errors from a receive or send the handler made on the stream directly.
_GONE = (ClientGone, trio.BrokenResourceError, trio.ClosedResourceError)


class Exchange:
    """One request and the means to answer it."""

    def __init__(self, stream: trio.SocketStream, request: Request) -> None:
        self._stream = stream
        self.method = request.method.decode("ascii", "replace").upper()
        self.target = request.target.decode("ascii", "replace")
        self.path = self.target.split("?", 1)[0]
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers.items()}
        self.body = request.body
        self.request_id: str | None = None  # set by the handler, for the log
        self.responded = False
        self.ended = False
        self.keep_alive = request.keep_alive  # whether the connection may carry another
        self._http10 = request.http10
        self._body: BodyWriter | None = None  # the answer's framing, once started
        self._no_body = self.method == "HEAD"

    async def _send(self, data: bytes) -> None:
        try:
            await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ClientGone() from exc

    async def start(self, status: int, content_type: str, length: int | None = None) -> None:
        lines = [f"HTTP/1.1 {status} {_REASON.get(status, '')}", f"content-type: {content_type}",
                 "server: llmgw-simengine"]
        body: BodyWriter | None = None
        if length is not None:
            lines.append(f"content-length: {length}")
            body = LengthWriter(length)
        elif self._http10:
            self.keep_alive = False  # the body ends with the connection
            body = CloseWriter()
        elif not self._no_body:
            body = ChunkedWriter()
            lines.append("transfer-encoding: chunked")
        self._body = None if self._no_body else body
        if not self.keep_alive:
            lines.append("connection: close")
        self.responded = True
        await self._send(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    async def send_body(self, data: bytes) -> None:
        if self._body is not None and data:
            await self._send(self._body.data(data))

    async def end(self) -> None:
        self.ended = True
        if self._body is not None and (tail := self._body.end()):
            await self._send(tail)

    async def send_bytes(self, status: int, content_type: str, data: bytes) -> None:
        await self.start(status, content_type, len(data))
        if data:
            await self.send_body(data)
        await self.end()

    async def send_json(self, status: int, obj: Any) -> None:
        await self.send_bytes(status, "application/json",
                              json.dumps(obj, separators=COMPACT, ensure_ascii=False).encode())


Handler = Callable[[Exchange], Awaitable[None]]


class _Conn:
    """One connection's parser and whether the client has closed its side."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.parser = RequestParser(MAX_BODY)
        self.eof = False

    async def next_request(self) -> Request | None:
        """The next whole request, or None when the client is gone. Raises H1Error."""
        p = self.parser
        while True:
            req = p.next()
            if req is not None:
                return req
            if self.eof:
                return None
            if p.continue_wanted:
                p.continue_wanted = False
                await self.stream.send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            data = await self.stream.receive_some(_RECV)
            if not data:
                self.eof = True
                if p.in_head or p.state:
                    raise H1Error(400, "the connection ended in the middle of a request")
                return None
            p.feed(bytes(data))

    async def watch_eof(self, scope: trio.CancelScope) -> None:
        """Cancel the handler when the client closes; keep any pipelined bytes."""
        while True:
            try:
                data = await self.stream.receive_some(_RECV)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self.eof = True
                scope.cancel()
                return
            self.parser.feed(bytes(data))


async def _run_handler(handler: Handler, conn: _Conn, ex: Exchange) -> bool:
    """Run one handler; False when the client went away before it finished.

    The handler runs inside a nursery (beside the EOF watcher), so a ClientGone it raises
    (a write that met EPIPE or a reset: a router's /metrics fetch that timed out and
    closed) comes out wrapped in an ExceptionGroup: `except*` takes it out of the group
    wherever it sits. Anything else the handler raises is left to propagate."""
    completed = False
    try:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(conn.watch_eof, scope)
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
    conn = _Conn(stream)
    try:
        while True:
            try:
                req = await conn.next_request()
            except H1Error as exc:
                log.info("bad HTTP request: %s", exc.message)
                await _send_error(stream, exc.status, exc.message)
                return
            if req is None:
                return
            ex = Exchange(stream, req)
            if not await _run_handler(handler, conn, ex):
                return
            if not ex.ended:
                log.warning("handler for %s %s left its response unfinished", ex.method, ex.path)
                return
            if not ex.keep_alive:
                return
    except (trio.BrokenResourceError, trio.ClosedResourceError, ClientGone) as exc:
        log.debug("connection dropped: %r", exc)
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


async def _send_error(stream: trio.SocketStream, status: int, message: str) -> None:
    body = json.dumps(_error(message, status)).encode()
    head = (f"HTTP/1.1 {status} {_REASON.get(status, '')}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode("latin-1")
    await stream.send_all(head + body)


def _error(message: str, status: int, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def error_body(message: str, status: int, kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error shape."""
    return _error(message, status, kind)

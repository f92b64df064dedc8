"""The server side of HTTP/1.1: h11 over a trio stream, keep-alive, a body limit.

One `ClientConn` per accepted connection. `next_request` returns the next request with its
whole body (bounded by `max_body`; over it raises TooLarge before reading the rest),
or None when the client is gone or the connection cannot be reused.
"""

from __future__ import annotations

import socket

import h11
import trio

RECV = 65536


class TooLarge(Exception):
    pass


class BadRequest(Exception):
    pass


def set_nodelay(stream: trio.SocketStream) -> None:
    try:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:  # not TCP (tests with unix sockets) or already closed
        pass


class Request:
    __slots__ = ("method", "target", "headers", "body", "keep_alive")

    def __init__(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.method = method
        self.target = target
        self.headers = headers
        self.body = body

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None


class ClientConn:
    __slots__ = ("stream", "h11", "max_body", "pending")

    def __init__(self, stream: trio.SocketStream, max_body: int) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=65536)
        self.max_body = max_body
        # Bytes the disconnect watcher read while a response was being relayed.
        self.pending = b""

    async def _event(self) -> h11.Event | type[h11.PAUSED] | type[h11.NEED_DATA]:
        while True:
            ev = self.h11.next_event()
            if ev is h11.NEED_DATA:
                if self.pending:
                    data, self.pending = self.pending, b""
                else:
                    data = await self.stream.receive_some(RECV)
                self.h11.receive_data(data)
                if not data and self.h11.their_state is not h11.DONE:
                    # EOF: h11 turns it into ConnectionClosed or an error next round.
                    pass
                continue
            return ev

    async def next_request(self) -> Request | None:
        conn = self.h11
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        elif conn.our_state is not h11.IDLE:
            return None
        try:
            ev = await self._event()
        except h11.RemoteProtocolError as exc:
            raise BadRequest(str(exc)) from exc
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return None
        if not isinstance(ev, h11.Request):
            return None
        length = None
        for k, v in ev.headers:
            if k == b"content-length":
                length = int(v)
        if length is not None and length > self.max_body:
            raise TooLarge()
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                b = await self._event()
            except h11.RemoteProtocolError as exc:
                raise BadRequest(str(exc)) from exc
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None
            if isinstance(b, h11.Data):
                size += len(b.data)
                if size > self.max_body:
                    raise TooLarge()
                chunks.append(bytes(b.data))
            elif isinstance(b, h11.EndOfMessage):
                break
            else:
                return None
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return Request(ev.method, ev.target, list(ev.headers), body)

    def start_response(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes | None = None
    ) -> bytes:
        """The bytes of a response head (and whole body, when given)."""
        out = self.h11.send(h11.Response(status_code=status, headers=headers)) or b""
        if body is not None:
            if body:
                out += self.h11.send(h11.Data(data=body)) or b""
            out += self.h11.send(h11.EndOfMessage()) or b""
        return out

    def data(self, data: bytes) -> bytes:
        return self.h11.send(h11.Data(data=data)) or b""

    def end(self) -> bytes:
        return self.h11.send(h11.EndOfMessage()) or b""

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def respond(self, status: int, content_type: bytes, body: bytes, close: bool = False) -> None:
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        await self.stream.send_all(self.start_response(status, headers, body))

    @property
    def can_respond(self) -> bool:
        return self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE)

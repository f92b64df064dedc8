"""The one writer of body framing (RFC 9112 section 6), sans-IO: data and end in, bytes out.

A body is framed one of three ways, as `ResponseHead.framing` names them; one writer each:

  chunked  `ChunkedWriter`: each piece of data one chunk (`%x\\r\\n` data `\\r\\n`); the end
           is the zero-size chunk and no trailers. Empty data writes nothing, since an
           empty chunk would end the body.
  length   `LengthWriter(n)`: the data as it is, exactly n bytes of it: more is refused at
           once, fewer at the end.
  close    `CloseWriter`: the data as it is; the end writes nothing (the connection's end
           is the body's, so the connection must not be reused; HTTP/1.0's only way).

`writer_for(framing, length)` picks one. `data(bytes)` and `end()` return the bytes to send;
the caller sends them (or gathers several into one send). Writing after the end, or what
the framing cannot carry, raises `FramingError`: a fault of the program, never of a peer,
so it is not an H1Error with a status to answer. `chunk(data)` frames one chunk alone,
for a relay that passes a peer's chunks on and writes one of its own between them.

The reader of what these write is `llmgw.http1.chunked.ChunkedReader` (chunked) or the
head's Content-Length; a test feeds every writer's output back through them.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["BodyWriter", "ChunkedWriter", "CloseWriter", "FramingError", "LengthWriter",
           "LAST_CHUNK", "chunk", "writer_for"]

LAST_CHUNK = b"0\r\n\r\n"  # the zero-size chunk and the empty line: no trailer fields


class FramingError(Exception):
    """The program asked a writer for what its framing cannot carry (too many or too few
    bytes for the length, data after the end)."""


class BodyWriter(Protocol):
    def data(self, data: bytes) -> bytes: ...

    def end(self) -> bytes: ...


def chunk(data: bytes) -> bytes:
    """One chunk holding `data`; nothing for empty data (a zero-size chunk is the end)."""
    return b"%x\r\n%s\r\n" % (len(data), data) if data else b""


class ChunkedWriter:
    __slots__ = ("ended",)

    def __init__(self) -> None:
        self.ended = False

    def data(self, data: bytes) -> bytes:
        if self.ended:
            raise FramingError("data after the end of a chunked body")
        return chunk(data)

    def end(self) -> bytes:
        if self.ended:
            raise FramingError("a chunked body ended twice")
        self.ended = True
        return LAST_CHUNK


class LengthWriter:
    __slots__ = ("left", "ended")

    def __init__(self, length: int) -> None:
        if length < 0:
            raise FramingError(f"a negative Content-Length ({length})")
        self.left = length
        self.ended = False

    def data(self, data: bytes) -> bytes:
        if self.ended:
            raise FramingError("data after the end of a body of known length")
        if len(data) > self.left:
            raise FramingError(f"{len(data)} bytes where {self.left} were left of the Content-Length")
        self.left -= len(data)
        return data

    def end(self) -> bytes:
        if self.ended:
            raise FramingError("a body of known length ended twice")
        if self.left:
            raise FramingError(f"the body ended {self.left} bytes short of its Content-Length")
        self.ended = True
        return b""


class CloseWriter:
    __slots__ = ("ended",)

    def __init__(self) -> None:
        self.ended = False

    def data(self, data: bytes) -> bytes:
        if self.ended:
            raise FramingError("data after the end of a body delimited by the connection's close")
        return data

    def end(self) -> bytes:
        if self.ended:
            raise FramingError("a body delimited by the connection's close ended twice")
        self.ended = True
        return b""


def writer_for(framing: str, length: int = 0) -> BodyWriter:
    """The writer of a framing named as `ResponseHead.framing` names it."""
    if framing == "chunked":
        return ChunkedWriter()
    if framing == "length":
        return LengthWriter(length)
    if framing == "close":
        return CloseWriter()
    raise FramingError(f"no framing called {framing!r}")

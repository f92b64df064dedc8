"""Requests from a client's bytes: `RequestParser`, sans-IO and total.

`feed(bytes)`, then `next()` gives a `Request` (the whole body read) or None (more bytes
needed); whatever bytes arrive, the only exception that leaves it is `H1Error`, whose
status is the answer. The rules (RFC 9112, strict where a proxy must be):

- one request line `METHOD SP target SP HTTP/1.x`, token header names, no whitespace
  before the colon, no obsolete line folding, no control characters but tab, no bare CR
  or LF: 400;
- a head (request line and fields) over MAX_HEAD bytes or over MAX_FIELDS fields: 431,
  whatever the reads it arrived in (the whole buffered head is measured);
- Content-Length digits only (never `int()` of an unbounded string: its length is checked
  first), repeated only with the same value, at most `max_body`: else 400, over it 413;
- Transfer-Encoding only `chunked`, once, never with Content-Length: 400;
- chunk-size HEXDIG only (1 to MAX_CHUNK_HEX digits; no `0x`, `_`, sign or space before
  it), an optional chunk-ext after `;`, the line at most MAX_CHUNK_LINE bytes, CRLF after
  each chunk's data: else 400; chunked payload over `max_body` (or framing more than
  twice it): 413; trailers bounded like a head (431).
"""

from __future__ import annotations

from llmgw.http1.chunked import ChunkedReader
from llmgw.http1.grammar import (
    MAX_FIELDS,
    MAX_HEAD,
    REQUEST_HEAD,
    TOKEN,
    H1Error,
    bad_controls,
    connection_tokens,
    fields,
    show,
)

__all__ = ["Request", "RequestParser"]


class Request:
    __slots__ = ("method", "target", "headers", "body", "http10", "keep_alive")

    def __init__(
        self,
        method: bytes,
        target: bytes,
        headers: dict[bytes, bytes],
        body: bytes,
        http10: bool = False,
        keep_alive: bool = True,
    ) -> None:
        self.method = method
        self.target = target
        self.headers = headers  # lower-case name → value (a repeated header: the last)
        self.body = body
        self.http10 = http10
        self.keep_alive = keep_alive

    def header(self, name: bytes) -> bytes | None:
        return self.headers.get(name)


# States of the request parser.
_HEAD, _LENGTH, _CHUNKED = range(3)


class RequestParser:
    """Requests from a client's bytes, one after another (pipelining allowed).

    `feed(data)` adds bytes; `next()` returns the next whole Request or None when more
    bytes are needed, and raises H1Error for a request that breaks the rules (after which
    the connection must be closed: the parser keeps raising it). `in_head` tells whether
    part of a request head is buffered (for the shell's head deadline); `state` is not 0
    while a head is in and its body is not; `continue_wanted` is set once when a head
    asked `Expect: 100-continue` and its body is not all here."""

    __slots__ = ("max_body", "buf", "state", "scan", "error", "continue_wanted", "_req",
                 "_length", "_chunks")

    def __init__(self, max_body: int) -> None:
        self.max_body = max_body
        self.buf = bytearray()
        self.state = _HEAD
        self.scan = 0  # where to look for the end of the head next time
        self.error: H1Error | None = None
        self.continue_wanted = False
        self._req: Request | None = None  # head parsed, body not complete
        self._length = 0
        self._chunks: ChunkedReader | None = None

    def feed(self, data: bytes) -> None:
        self.buf += data

    @property
    def in_head(self) -> bool:
        return self.state == _HEAD and len(self.buf) > 0

    def next(self) -> Request | None:
        if self.error is not None:
            raise self.error
        try:
            if self.state == _HEAD:
                return self._head()
            if self.state == _LENGTH:
                return self._length_body()
            return self._chunked()
        except H1Error as exc:
            self.error = exc
            raise

    # ---- the head ------------------------------------------------------------------

    def _head(self) -> Request | None:
        buf = self.buf
        if buf[:1] == b"\r" or buf[:1] == b"\n":
            del buf[: len(buf) - len(buf.lstrip(b"\r\n"))]  # empty lines before a request
            self.scan = 0
        end = buf.find(b"\r\n\r\n", self.scan)
        if end < 0:
            if len(buf) > MAX_HEAD:
                raise H1Error(431, f"request head larger than {MAX_HEAD} bytes")
            self.scan = max(0, len(buf) - 3)
            return None
        self.scan = 0
        if end > MAX_HEAD:
            raise H1Error(431, f"request head larger than {MAX_HEAD} bytes")
        head = bytes(buf[:end])
        del buf[: end + 4]
        checked = REQUEST_HEAD.fullmatch(head) is not None  # then the checks below hold
        if not checked:
            if head.count(b"\r\n") > MAX_FIELDS:
                raise H1Error(431, f"more than {MAX_FIELDS} header fields")
            if bad_controls(head):
                raise H1Error(400, "control character in the request head")
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if not checked and (len(parts) != 3 or not TOKEN.fullmatch(parts[0]) or not parts[1]):
            raise H1Error(400, f"bad request line {show(lines[0], 80)}")
        method, target, version = parts
        if version == b"HTTP/1.1":
            http10 = False
        elif version == b"HTTP/1.0":
            http10 = True
        else:
            raise H1Error(400, f"unsupported HTTP version {show(version, 20)}")
        headers, length, te = fields(lines, checked, 400, self.max_body, 413)
        if te is not None:
            if te.lower() != b"chunked":
                raise H1Error(400, f"unsupported transfer-encoding {show(te)}")
            if length >= 0:
                raise H1Error(400, "both content-length and transfer-encoding")
        conn = headers.get(b"connection")
        if conn is None:
            keep_alive = not http10
        else:
            tokens = connection_tokens(conn)
            keep_alive = b"close" not in tokens and (not http10 or b"keep-alive" in tokens)
        req = Request(method, target, headers, b"", http10, keep_alive)
        if te is not None:
            self._chunks = ChunkedReader(400, keep=True, limit=self.max_body, big=431, strict=True)
            self._begin_body(req, _CHUNKED)
            return self._chunked()
        if length <= 0:
            return req
        if len(buf) >= length:
            req.body = bytes(buf[:length])
            del buf[:length]
            return req
        self._length = length
        self._begin_body(req, _LENGTH)
        return None

    def _begin_body(self, req: Request, state: int) -> None:
        self._req = req
        self.state = state
        self.continue_wanted = not req.http10 and req.headers.get(b"expect", b"").lower() == b"100-continue"

    def _done(self, body: bytes) -> Request:
        req = self._req
        assert req is not None
        req.body = body
        self._req = None
        self.state = _HEAD
        self.continue_wanted = False
        return req

    # ---- bodies --------------------------------------------------------------------

    def _length_body(self) -> Request | None:
        buf = self.buf
        n = self._length
        if len(buf) < n:
            return None
        body = bytes(buf[:n])
        del buf[:n]
        return self._done(body)

    def _chunked(self) -> Request | None:
        reader = self._chunks
        assert reader is not None
        if not self.buf:
            return None
        data = bytes(self.buf)
        self.buf.clear()
        _, done = reader.feed(data)
        if not done:
            return None
        self.buf += reader.rest  # the next request's bytes, when pipelined
        self._chunks = None
        assert reader.body is not None
        return self._done(bytes(reader.body))

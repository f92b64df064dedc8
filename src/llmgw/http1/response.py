"""An engine's answer from its bytes: `parse_response_head` and `ResponseParser`, sans-IO.

`ResponseParser.feed(bytes)` and `eof()` take what the connection gives; `head()` returns
the answer's head once it is all there (1xx heads skipped, the head bounded by MAX_HEAD)
or None; then either `take()` hands over the bytes after the head (a relay forwards the
body itself, with `chunked.ChunkedReader`), or `body()` returns a whole small body
(/metrics, /health) once it is all there. Errors are H1Error with status 502: a head that
is not HTTP/1.1 as llmgw accepts it, or an engine that ended the exchange early.
"""

from __future__ import annotations

from llmgw.http1.chunked import ChunkedReader
from llmgw.http1.grammar import (
    MAX_FIELDS,
    MAX_HEAD,
    MAX_LENGTH_DIGITS,
    RESPONSE_HEAD,
    STATUS,
    H1Error,
    bad_controls,
    connection_tokens,
    fields,
    show,
)

__all__ = ["ResponseHead", "ResponseParser", "parse_response_head"]


class ResponseHead:
    """A parsed response head; `framing` is "chunked", "length" or "close"."""

    __slots__ = ("status", "content_type", "length", "framing", "keep_alive")

    def __init__(self, status: int, content_type: bytes, length: int, framing: str, ka: bool):
        self.status = status
        self.content_type = content_type
        self.length = length
        self.framing = framing
        self.keep_alive = ka


# Heads parsed lately, by their bytes: an engine sends the same head again and again
# (streams above all), and a head that was checked once need not be checked again. Small
# heads only, a bounded number (emptied when full); ResponseHead is never changed.
_HEAD_CACHE: dict[bytes, ResponseHead] = {}
HEAD_CACHE_SIZE = 64
HEAD_CACHE_BYTES = 512


def parse_response_head(raw: bytes) -> ResponseHead:
    """An engine's response head (without the final CRLFCRLF). Raises H1Error(502)."""
    head = _HEAD_CACHE.get(raw)
    if head is not None:
        return head
    head = _parse_response_head(raw)
    if len(raw) <= HEAD_CACHE_BYTES:
        if len(_HEAD_CACHE) >= HEAD_CACHE_SIZE:
            _HEAD_CACHE.clear()
        _HEAD_CACHE[raw] = head
    return head


def _parse_response_head(raw: bytes) -> ResponseHead:
    if len(raw) > MAX_HEAD:
        raise H1Error(502, f"response head larger than {MAX_HEAD} bytes")
    m = RESPONSE_HEAD.fullmatch(raw)  # then the checks below hold
    checked = m is not None
    if m is None:
        if raw.count(b"\r\n") > MAX_FIELDS:
            raise H1Error(502, f"more than {MAX_FIELDS} header fields in the response")
        if bad_controls(raw):
            raise H1Error(502, "control character in the response head")
    lines = raw.split(b"\r\n")
    if m is None:
        m = STATUS.fullmatch(lines[0])
        if m is None:
            raise H1Error(502, f"bad status line {show(lines[0], 80)}")
    headers, length, te = fields(lines, checked, 502, 10**MAX_LENGTH_DIGITS - 1, 502,
                                " in the response")
    ka = m.group(1) == b"1"
    conn = headers.get(b"connection")
    if conn is not None:
        tokens = connection_tokens(conn)
        ka = b"close" not in tokens if ka else b"keep-alive" in tokens
    chunked = False
    if te is not None:
        if length >= 0:
            raise H1Error(502, "both content-length and transfer-encoding in the response")
        codings = [t.strip() for t in te.lower().split(b",")]
        if b"chunked" in codings[:-1]:
            raise H1Error(502, f"chunked is not the last transfer coding: {show(te)}")
        chunked = codings[-1] == b"chunked"
    if chunked:
        framing = "chunked"
    elif te is None and length >= 0:
        framing = "length"
    else:
        framing, ka = "close", False
    return ResponseHead(int(m.group(2)), headers.get(b"content-type", b"application/json"), length,
                        framing, ka)


class ResponseParser:
    """One connection's answers, one exchange at a time (see the module's docstring).
    `clean` is set when a whole body ended exactly where the engine said, on a connection
    it keeps open (it may carry the next exchange)."""

    __slots__ = ("buf", "closed", "scan", "current", "clean", "_chunks", "_parts", "_have")

    def __init__(self) -> None:
        self.buf = b""
        self.closed = False
        self.scan = 0  # where to look for the end of the head next time
        self.current: ResponseHead | None = None
        self.clean = False
        self._chunks: ChunkedReader | None = None
        self._parts: list[bytes] = []
        self._have = 0  # bytes in _parts

    def feed(self, data: bytes) -> None:
        self.buf = self.buf + data if self.buf else data

    def eof(self) -> None:
        self.closed = True

    def head(self) -> ResponseHead | None:
        """The next final head (a 1xx one is skipped), or None until it is all here."""
        while True:
            buf = self.buf
            end = buf.find(b"\r\n\r\n", self.scan)
            if end < 0:
                if len(buf) > MAX_HEAD:
                    raise H1Error(502, "response head too large")
                if self.closed:
                    raise H1Error(502, "engine closed the connection without answering")
                self.scan = max(0, len(buf) - 3)
                return None
            self.scan = 0
            head = parse_response_head(buf[:end])
            self.buf = buf[end + 4 :]
            if 100 <= head.status < 200:
                continue
            self.current = head
            self.clean = False
            self._chunks = ChunkedReader(502, keep=True) if head.framing == "chunked" else None
            self._parts = []
            self._have = 0
            return head

    def take(self) -> bytes:
        """The bytes received past the head (the relay reads the body on from there)."""
        data, self.buf = self.buf, b""
        return data

    def body(self) -> bytes | None:
        """The whole body of the current answer, or None until it is all here."""
        head = self.current
        assert head is not None, "body() before head()"
        data, self.buf = self.buf, b""
        if head.framing == "length":
            self._parts.append(data)
            self._have += len(data)
            if self._have < head.length:
                if self.closed:
                    raise H1Error(502, "engine closed the connection mid-body")
                return None
            whole = b"".join(self._parts)
            self.clean = head.keep_alive and len(whole) == head.length
            return self._end(whole[: head.length])
        if self._chunks is not None:
            if data:
                self._chunks.feed(data)
            if self._chunks.done:
                self.clean = head.keep_alive and not self._chunks.extra
                assert self._chunks.body is not None
                return self._end(bytes(self._chunks.body))
            if self.closed:
                raise H1Error(502, "engine closed the connection mid-body")
            return None
        self._parts.append(data)  # delimited by the connection's end
        return self._end(b"".join(self._parts)) if self.closed else None

    def _end(self, body: bytes) -> bytes:
        self.current = None
        self._chunks = None
        self._parts = []
        self._have = 0
        return body

"""Sans-IO HTTP/1.1 for the router: bytes in, requests, heads and chunks out.

Pure and total: no sockets, no clock, and whatever bytes arrive the only exception that
leaves these functions is `H1Error`, which carries the HTTP status to answer with (4xx
for a client's request, 502 for an engine's answer). The trio shells around them are
`http.ClientConn` (client side) and `upstream.UpstreamConn` (engine side).

Client side, `RequestParser`: `feed(bytes)`, then `next()` gives a `Request` (the whole
body read) or None (more bytes needed). The rules (RFC 9112, strict where a proxy must be):

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

Engine side: `parse_response_head`, `ChunkScanner` (follows the framing of bytes relayed
as they are), `dechunk` (a whole small body). The same grammar, errors with status 502.
"""

from __future__ import annotations

import re

from llmgw.errors import ProtocolError

__all__ = [
    "MAX_FIELDS",
    "MAX_HEAD",
    "ChunkScanner",
    "H1Error",
    "Request",
    "RequestParser",
    "ResponseHead",
    "dechunk",
    "parse_response_head",
]

MAX_HEAD = 65536  # bytes of a request or response head (request line and fields)
MAX_FIELDS = 100  # header fields in one head
MAX_CHUNK_LINE = 1024  # bytes of a chunk-size line (size and chunk-ext)
MAX_CHUNK_HEX = 16  # hex digits of a chunk size
MAX_LENGTH_DIGITS = 18  # digits of an engine's Content-Length (below 2**63)

_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
# Control characters other than tab, CR and LF (CR and LF are checked to come in pairs).
_CTL_BYTES = bytes(range(0x00, 0x09)) + b"\x0b\x0c" + bytes(range(0x0E, 0x20)) + b"\x7f"
_HEX = b"0123456789abcdefABCDEF"
# chunk-size [ chunk-ext ]: HEXDIG only, then optionally `;` and anything but controls.
_CHUNK = re.compile(rb"([0-9A-Fa-f]{1,%d})(?:[ \t]*;[^\x00-\x08\x0a-\x1f\x7f]*)?" % MAX_CHUNK_HEX)
_STATUS = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9][0-9])(?: [^\r\n]*)?")
# The whole grammar of a head in one pass (C speed), for the usual head: token names, no
# control but tab, CR and LF only as CRLF pairs, at most MAX_FIELDS fields. A head it
# accepts passes every check of the slow path (it accepts a subset of what those do);
# a head it rejects goes through the slow path, which names what is wrong.
_TCHAR = rb"-!#$%&'*+.^_`|~0-9A-Za-z"
_TEXT = rb"[^\x00-\x08\x0a-\x1f\x7f]"  # a field value's bytes: no control but tab
_FIELDS = rb"(?:\r\n[%s]+:%s*){0,%d}" % (_TCHAR, _TEXT, MAX_FIELDS)
_REQUEST_HEAD = re.compile(
    rb"[%s]+ [^\x00-\x08\x0a-\x1f\x7f ]+ HTTP/1\.[01]%s" % (_TCHAR, _FIELDS)
)
_RESPONSE_HEAD = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9][0-9])(?: %s*)?%s" % (_TEXT, _FIELDS))


class H1Error(ProtocolError):
    """Bytes that are not HTTP/1.1 as the router accepts it; `status` is the answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _show(b: bytes | bytearray, n: int = 40) -> str:
    return repr(bytes(b[:n])) + ("…" if len(b) > n else "")


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


def _bad_controls(b: bytes) -> bool:
    """A control character other than tab, or a CR or LF that is not part of a CRLF pair
    (C-speed bytes operations: a regex with look-arounds costs several times more)."""
    if len(b.translate(None, _CTL_BYTES)) != len(b):
        return True
    n = b.count(b"\r\n")
    return b.count(b"\r") != n or b.count(b"\n") != n


def _chunk_size(data: bytes | bytearray, pos: int, nl: int, status: int) -> int:
    s = data[pos:nl]
    if 0 < len(s) <= MAX_CHUNK_HEX and not s.translate(None, _HEX):
        return int(s, 16)  # HEXDIG only, no chunk-ext: the usual line
    m = _CHUNK.fullmatch(data, pos, nl)
    if m is None:
        raise H1Error(status, f"bad chunk size line {_show(data[pos:nl])}")
    return int(m.group(1), 16)


def _content_length(value: bytes, limit: int, status_over: int, status_bad: int) -> int:
    if not value.isdigit():  # bytes.isdigit: ASCII 0-9 only, and not empty
        raise H1Error(status_bad, f"bad content-length {_show(value)}")
    if len(value) < 16:  # the usual case: no more digits than int() handles at once
        n = int(value)
        if n > limit:
            raise H1Error(status_over, f"content-length {n} over {limit}")
        return n
    digits = value.lstrip(b"0")
    if len(digits) > len(str(limit)):
        raise H1Error(status_over, f"content-length {_show(value)} over {limit}")
    n = int(digits) if digits else 0
    if n > limit:
        raise H1Error(status_over, f"content-length {n} over {limit}")
    return n


# States of the request parser.
_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _TRAILER = range(5)


class RequestParser:
    """Requests from a client's bytes, one after another (pipelining allowed).

    `feed(data)` adds bytes; `next()` returns the next whole Request or None when more
    bytes are needed, and raises H1Error for a request that breaks the rules (after which
    the connection must be closed: the parser keeps raising it). `in_head` tells whether
    part of a request head is buffered (for the shell's head deadline); `continue_wanted`
    is set once when a head asked `Expect: 100-continue` and its body is not all here."""

    __slots__ = (
        "max_body",
        "buf",
        "state",
        "scan",
        "error",
        "continue_wanted",
        "_req",
        "_length",
        "_pos",
        "_body",
        "_size",
        "_wire",
        "_trailer_at",
        "_trailers",
    )

    def __init__(self, max_body: int) -> None:
        self.max_body = max_body
        self.buf = bytearray()
        self.state = _HEAD
        self.scan = 0  # where to look for the end of the head next time
        self.error: H1Error | None = None
        self.continue_wanted = False
        self._req: Request | None = None  # head parsed, body not complete
        self._length = 0
        self._pos = 0  # chunked: position in buf
        self._body = bytearray()
        self._size = 0
        self._wire = 0
        self._trailer_at = 0
        self._trailers = 0

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
        checked = _REQUEST_HEAD.fullmatch(head) is not None  # then the checks below hold
        if not checked:
            if head.count(b"\r\n") > MAX_FIELDS:
                raise H1Error(431, f"more than {MAX_FIELDS} header fields")
            if _bad_controls(head):
                raise H1Error(400, "control character in the request head")
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if not checked and (len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not parts[1]):
            raise H1Error(400, f"bad request line {_show(lines[0], 80)}")
        method, target, version = parts
        if version == b"HTTP/1.1":
            http10 = False
        elif version == b"HTTP/1.0":
            http10 = True
        else:
            raise H1Error(400, f"unsupported HTTP version {_show(version, 20)}")
        headers: dict[bytes, bytes] = {}
        length = -1
        chunked = False
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not checked and (not sep or not _TOKEN.fullmatch(name)):
                raise H1Error(400, f"bad header line {_show(line, 80)}")
            name = name.lower()
            value = value.strip(b" \t")
            if name == b"content-length":
                n = _content_length(value, self.max_body, 413, 400)
                if length >= 0 and n != length:
                    raise H1Error(400, "two different content-length values")
                length = n
            elif name == b"transfer-encoding":
                if value.lower() != b"chunked" or chunked:
                    raise H1Error(400, f"unsupported transfer-encoding {_show(value)}")
                chunked = True
            headers[name] = value
        if chunked and length >= 0:
            raise H1Error(400, "both content-length and transfer-encoding")
        conn = headers.get(b"connection")
        if conn is None:
            keep_alive = not http10
        else:
            tokens = {t.strip() for t in conn.lower().split(b",")}
            keep_alive = b"close" not in tokens and (not http10 or b"keep-alive" in tokens)
        req = Request(method, target, headers, b"", http10, keep_alive)
        if chunked:
            self._begin_body(req, _CHUNK_SIZE)
            self._pos = 0
            self._body = bytearray()
            self._wire = 0
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
        buf = self.buf
        pos = self._pos
        limit = self.max_body
        try:
            while True:
                state = self.state
                if state == _CHUNK_DATA:
                    size = self._size
                    if len(buf) < pos + size + 2:
                        return None
                    if buf[pos + size : pos + size + 2] != b"\r\n":
                        raise H1Error(400, "chunk data not followed by CRLF")
                    self._body += buf[pos : pos + size]
                    pos += size + 2
                    self.state = _CHUNK_SIZE
                    continue
                nl = buf.find(b"\r\n", pos)
                if state == _CHUNK_SIZE:
                    if nl < 0:
                        if len(buf) - pos > MAX_CHUNK_LINE:
                            raise H1Error(400, "chunk size line too long")
                        return None
                    if nl - pos > MAX_CHUNK_LINE:
                        raise H1Error(400, "chunk size line too long")
                    size = _chunk_size(buf, pos, nl, 400)
                    self._wire += nl + 2 - pos + size + 2
                    pos = nl + 2
                    if size == 0:
                        self.state = _TRAILER
                        self._trailer_at = pos
                        self._trailers = 0
                        continue
                    if len(self._body) + size > limit:
                        raise H1Error(413, f"request body is larger than {limit} bytes")
                    if self._wire > 2 * limit + MAX_HEAD:
                        raise H1Error(413, "chunked framing much larger than the body limit")
                    self._size = size
                    self.state = _CHUNK_DATA
                    continue
                # Trailer fields (ignored), bounded like a head, up to an empty line.
                if nl < 0:
                    if len(buf) - self._trailer_at > MAX_HEAD:
                        raise H1Error(431, "trailers too large")
                    return None
                if nl == pos:
                    body = bytes(self._body)
                    self._body = bytearray()
                    del buf[: pos + 2]
                    pos = 0
                    return self._done(body)
                if nl - self._trailer_at > MAX_HEAD:
                    raise H1Error(431, "trailers too large")
                line = bytes(buf[pos:nl])
                name, sep, _ = line.partition(b":")
                if not sep or not _TOKEN.fullmatch(name) or _bad_controls(line):
                    raise H1Error(400, f"bad trailer line {_show(line)}")
                self._trailers += 1
                if self._trailers > MAX_FIELDS:
                    raise H1Error(431, f"more than {MAX_FIELDS} trailer fields")
                pos = nl + 2
        finally:
            # Drop what was consumed, so the buffer holds only what is not parsed yet.
            if pos > 65536:
                del buf[:pos]
                self._trailer_at -= pos
                pos = 0
            self._pos = pos


# ---- engine side -------------------------------------------------------------------------


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
    m = _RESPONSE_HEAD.fullmatch(raw)  # then the checks below hold
    checked = m is not None
    if m is None:
        if raw.count(b"\r\n") > MAX_FIELDS:
            raise H1Error(502, f"more than {MAX_FIELDS} header fields in the response")
        if _bad_controls(raw):
            raise H1Error(502, "control character in the response head")
    lines = raw.split(b"\r\n")
    if m is None:
        m = _STATUS.fullmatch(lines[0])
        if m is None:
            raise H1Error(502, f"bad status line {_show(lines[0], 80)}")
    ctype = b"application/json"
    length = -1
    te: bytes | None = None
    ka = m.group(1) == b"1"
    for line in lines[1:]:
        k, sep, v = line.partition(b":")
        if not checked and (not sep or not _TOKEN.fullmatch(k)):
            raise H1Error(502, f"bad header line {_show(line, 80)}")
        k = k.lower()
        v = v.strip(b" \t")
        if k == b"content-type":
            ctype = v
        elif k == b"content-length":
            n = _content_length(v, 10**MAX_LENGTH_DIGITS - 1, 502, 502)
            if length >= 0 and n != length:
                raise H1Error(502, "two different content-length values in the response")
            length = n
        elif k == b"transfer-encoding":
            te = v if te is None else te + b"," + v
        elif k == b"connection":
            tokens = {t.strip() for t in v.lower().split(b",")}
            ka = b"close" not in tokens if ka else b"keep-alive" in tokens
    chunked = False
    if te is not None:
        if length >= 0:
            raise H1Error(502, "both content-length and transfer-encoding in the response")
        codings = [t.strip() for t in te.lower().split(b",")]
        if b"chunked" in codings[:-1]:
            raise H1Error(502, f"chunked is not the last transfer coding: {_show(te)}")
        chunked = codings[-1] == b"chunked"
    if chunked:
        framing = "chunked"
    elif te is None and length >= 0:
        framing = "length"
    else:
        framing, ka = "close", False
    return ResponseHead(int(m.group(2)), ctype, length, framing, ka)


class ChunkScanner:
    """Follows chunked framing over raw bytes without copying payload.

    `feed(data)` returns (bytes to forward now, done). Forwarded bytes are the engine's
    chunks exactly as received, minus the final zero-size chunk and trailers, which the
    client side writes itself; a chunk-size line split across reads is held until whole.
    Every chunk-size line is checked (HEXDIG, bounded) and so is the CRLF after each
    chunk's data, so what goes on to the client is well framed. `extra` is set when bytes
    followed the end of the body (the connection is then not reused).
    """

    __slots__ = ("remaining", "partial", "in_trailer", "extra")

    def __init__(self) -> None:
        self.remaining = 0  # payload + CRLF bytes left in the current chunk
        self.partial = b""
        self.in_trailer = False
        self.extra = False

    def feed(self, data: bytes) -> tuple[bytes, bool]:
        if self.partial:
            data = self.partial + data
            self.partial = b""
        if self.in_trailer:
            return b"", self._trailer_done(data)
        n = len(data)
        pos = 0
        while pos < n:
            r = self.remaining
            if r:
                if r > 2:
                    take = min(r - 2, n - pos)
                    pos += take
                    r -= take
                    if r > 2 or pos == n:
                        self.remaining = r
                        continue
                # r is 2 or 1: the CRLF after the chunk's data, maybe split across reads.
                if r == 2 and data.startswith(b"\r\n", pos):
                    pos += 2
                    self.remaining = 0
                    continue
                if r == 2:
                    if data[pos] != 13:
                        raise H1Error(502, "chunk data not followed by CRLF")
                    pos += 1
                    if pos == n:
                        self.remaining = 1
                        continue
                if data[pos] != 10:
                    raise H1Error(502, "chunk data not followed by CRLF")
                pos += 1
                self.remaining = 0
                continue
            nl = data.find(b"\r\n", pos)
            if nl < 0:
                if n - pos > MAX_CHUNK_LINE:
                    raise H1Error(502, "chunk size line too long")
                self.partial = data[pos:]
                return data[:pos], False
            if nl - pos > MAX_CHUNK_LINE:
                raise H1Error(502, "chunk size line too long")
            size = _chunk_size(data, pos, nl, 502)
            if size == 0:
                self.in_trailer = True
                return data[:pos], self._trailer_done(data[nl + 2 :])
            self.remaining = size + 2
            pos = nl + 2
        return data, False

    def _trailer_done(self, rest: bytes) -> bool:
        # After the zero-size chunk: trailers (usually none) end at an empty line.
        if rest.startswith(b"\r\n"):
            self.extra = len(rest) > 2
            return True
        end = rest.find(b"\r\n\r\n")
        if end >= 0:
            self.extra = len(rest) > end + 4
            return True
        if len(rest) > MAX_HEAD:
            raise H1Error(502, "trailers too large")
        self.partial = rest
        return False


def dechunk(raw: bytes) -> bytes:
    """The payload of a whole chunked body (trailers ignored). Raises H1Error(502)."""
    out: list[bytes] = []
    pos = 0
    n = len(raw)
    while True:
        nl = raw.find(b"\r\n", pos)
        if nl < 0 or nl - pos > MAX_CHUNK_LINE:
            raise H1Error(502, "truncated or bad chunked body")
        size = _chunk_size(raw, pos, nl, 502)
        if size == 0:
            return b"".join(out)
        start = nl + 2
        end = start + size
        if end + 2 > n or raw[end : end + 2] != b"\r\n":
            raise H1Error(502, "truncated chunked body")
        out.append(raw[start:end])
        pos = end + 2

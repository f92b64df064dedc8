"""The pieces of RFC 9112's grammar that requests, responses and chunked bodies share:
the limits, `H1Error`, the one-pass head patterns, and the one header-field loop.

Pure: bytes in, values or `H1Error` out. `H1Error.status` is the HTTP status to answer
with: 4xx for a client's request, 502 for an engine's answer.
"""

from __future__ import annotations

import re

from llmgw.errors import ProtocolError

MAX_HEAD = 65536  # bytes of a request or response head (start line and fields)
MAX_FIELDS = 100  # header fields in one head
MAX_CHUNK_LINE = 1024  # bytes of a chunk-size line (size and chunk-ext)
MAX_CHUNK_HEX = 16  # hex digits of a chunk size
MAX_LENGTH_DIGITS = 18  # digits of an engine's Content-Length (below 2**63)

TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
# Control characters other than tab, CR and LF (CR and LF are checked to come in pairs).
_CTL_BYTES = bytes(range(0x00, 0x09)) + b"\x0b\x0c" + bytes(range(0x0E, 0x20)) + b"\x7f"
_HEX = b"0123456789abcdefABCDEF"
# chunk-size [ chunk-ext ]: HEXDIG only, then optionally `;` and anything but controls.
_CHUNK = re.compile(rb"([0-9A-Fa-f]{1,%d})(?:[ \t]*;[^\x00-\x08\x0a-\x1f\x7f]*)?" % MAX_CHUNK_HEX)
STATUS = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9][0-9])(?: [^\r\n]*)?")
# The whole grammar of a head in one pass (C speed), for the usual head: token names, no
# control but tab, CR and LF only as CRLF pairs, at most MAX_FIELDS fields. A head it
# accepts passes every check of the slow path (it accepts a subset of what those do);
# a head it rejects goes through the slow path, which names what is wrong.
_TCHAR = rb"-!#$%&'*+.^_`|~0-9A-Za-z"
_TEXT = rb"[^\x00-\x08\x0a-\x1f\x7f]"  # a field value's bytes: no control but tab
_FIELDS = rb"(?:\r\n[%s]+:%s*){0,%d}" % (_TCHAR, _TEXT, MAX_FIELDS)
REQUEST_HEAD = re.compile(
    rb"[%s]+ [^\x00-\x08\x0a-\x1f\x7f ]+ HTTP/1\.[01]%s" % (_TCHAR, _FIELDS)
)
RESPONSE_HEAD = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9][0-9])(?: %s*)?%s" % (_TEXT, _FIELDS))


class H1Error(ProtocolError):
    """Bytes that are not HTTP/1.1 as llmgw accepts it; `status` is the answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def show(b: bytes | bytearray, n: int = 40) -> str:
    return repr(bytes(b[:n])) + ("…" if len(b) > n else "")


def bad_controls(b: bytes) -> bool:
    """A control character other than tab, or a CR or LF that is not part of a CRLF pair
    (C-speed bytes operations: a regex with look-arounds costs several times more)."""
    if len(b.translate(None, _CTL_BYTES)) != len(b):
        return True
    n = b.count(b"\r\n")
    return b.count(b"\r") != n or b.count(b"\n") != n


def chunk_size(data: bytes | bytearray, pos: int, nl: int, status: int) -> int:
    """The size on the chunk-size line data[pos:nl] (its chunk-ext ignored)."""
    s = data[pos:nl]
    if 0 < len(s) <= MAX_CHUNK_HEX and not s.translate(None, _HEX):
        return int(s, 16)  # HEXDIG only, no chunk-ext: the usual line
    m = _CHUNK.fullmatch(data, pos, nl)
    if m is None:
        raise H1Error(status, f"bad chunk size line {show(data[pos:nl])}")
    return int(m.group(1), 16)


def content_length(value: bytes, limit: int, status_over: int, status_bad: int) -> int:
    """Content-Length digits, never `int()` of an unbounded string (its length first)."""
    if not value.isdigit():  # bytes.isdigit: ASCII 0-9 only, and not empty
        raise H1Error(status_bad, f"bad content-length {show(value)}")
    if len(value) < 16:  # the usual case: no more digits than int() handles at once
        n = int(value)
        if n > limit:
            raise H1Error(status_over, f"content-length {n} over {limit}")
        return n
    digits = value.lstrip(b"0")
    if len(digits) > len(str(limit)):
        raise H1Error(status_over, f"content-length {show(value)} over {limit}")
    n = int(digits) if digits else 0
    if n > limit:
        raise H1Error(status_over, f"content-length {n} over {limit}")
    return n


def fields(
    lines: list[bytes], checked: bool, status: int, limit: int, status_over: int, where: str = ""
) -> tuple[dict[bytes, bytes], int, bytes | None]:
    """The header fields of a head (`lines[1:]`, after the start line): (lower-case name
    -> value, a repeated field: the last; Content-Length or -1; the Transfer-Encoding
    values joined by commas or None). `checked`: the one-pass pattern accepted the head,
    so its lines need no check here. Content-Length is bounded by `limit` (over it:
    `status_over`) and may repeat only with the same value; `where` ends that message
    (" in the response")."""
    headers: dict[bytes, bytes] = {}
    length = -1
    te: bytes | None = None
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not checked and (not sep or not TOKEN.fullmatch(name)):
            raise H1Error(status, f"bad header line {show(line, 80)}")
        name = name.lower()
        value = value.strip(b" \t")
        if name == b"content-length":
            n = content_length(value, limit, status_over, status)
            if length >= 0 and n != length:
                raise H1Error(status, f"two different content-length values{where}")
            length = n
        elif name == b"transfer-encoding":
            te = value if te is None else te + b"," + value
        headers[name] = value
    return headers, length, te


def connection_tokens(value: bytes) -> set[bytes]:
    return {t.strip() for t in value.lower().split(b",")}

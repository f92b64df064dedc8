"""The one reader of chunked framing (RFC 9112 section 7.1), for requests and responses.

`ChunkedReader.feed(data)` returns (bytes to forward, done): the chunks exactly as they
arrived, minus the final zero-size chunk and the trailers, so that a relay can pass an
engine's chunks on byte for byte (the client side writes the end itself); a chunk-size
line split across reads is held until whole. With `keep`, the payload is gathered in
`body` too (a request's body, a small answer's). Every chunk-size line is checked (HEXDIG,
bounded) and so is the CRLF after each chunk's data, so what is forwarded is well framed.
Trailer fields are read up to the empty line and dropped, bounded like a head (and with
`strict`, checked like header fields). Bytes after the end are kept in `rest`.

The statuses: `status` for bad framing (400 for a request, 502 for an engine's answer),
`over` when the payload passes `limit` or the framing more than twice it (413), `big` for
trailers over the bounds (431 for a request).
"""

from __future__ import annotations

from llmgw.http1.grammar import (
    MAX_CHUNK_LINE,
    MAX_FIELDS,
    MAX_HEAD,
    TOKEN,
    H1Error,
    bad_controls,
    chunk_size,
    show,
)

__all__ = ["ChunkedReader", "dechunk"]


class ChunkedReader:
    __slots__ = (
        "remaining", "partial", "in_trailer", "done", "rest", "body", "status", "limit", "over",
        "big", "strict", "_wire", "_trailer_bytes", "_trailers",
    )

    def __init__(
        self,
        status: int = 502,
        *,
        keep: bool = False,
        limit: int | None = None,
        over: int = 413,
        big: int | None = None,
        strict: bool = False,
    ) -> None:
        self.remaining = 0  # payload + CRLF bytes left in the current chunk
        self.partial = b""  # an incomplete chunk-size or trailer line
        self.in_trailer = False
        self.done = False
        self.rest = b""  # bytes after the end of the body
        self.body: bytearray | None = bytearray() if keep else None
        self.status = status
        self.limit = limit
        self.over = over
        self.big = status if big is None else big
        self.strict = strict
        self._wire = 0  # framing bytes seen, for the limit
        self._trailer_bytes = 0
        self._trailers = 0

    @property
    def extra(self) -> bool:
        """Bytes followed the end of the body (a connection then is not reused)."""
        return bool(self.rest)

    def feed(self, data: bytes) -> tuple[bytes, bool]:
        if self.partial:
            data = self.partial + data
            self.partial = b""
        if self.in_trailer:
            return b"", self._trailer(data, 0)
        body = self.body
        n = len(data)
        pos = 0
        while pos < n:
            r = self.remaining
            if r:
                if r > 2:
                    take = min(r - 2, n - pos)
                    if body is not None:
                        body += data[pos : pos + take]
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
                        raise H1Error(self.status, "chunk data not followed by CRLF")
                    pos += 1
                    if pos == n:
                        self.remaining = 1
                        continue
                if data[pos] != 10:
                    raise H1Error(self.status, "chunk data not followed by CRLF")
                pos += 1
                self.remaining = 0
                continue
            nl = data.find(b"\r\n", pos)
            if nl < 0:
                if n - pos > MAX_CHUNK_LINE:
                    raise H1Error(self.status, "chunk size line too long")
                self.partial = data[pos:]
                return data[:pos], False
            if nl - pos > MAX_CHUNK_LINE:
                raise H1Error(self.status, "chunk size line too long")
            size = chunk_size(data, pos, nl, self.status)
            if size == 0:
                self.in_trailer = True
                return data[:pos], self._trailer(data, nl + 2)
            if self.limit is not None:
                self._bound(size, nl + 2 - pos)
            self.remaining = size + 2
            pos = nl + 2
        return data, False

    def _bound(self, size: int, line: int) -> None:
        limit = self.limit
        assert limit is not None and self.body is not None
        self._wire += line + size + 2
        if len(self.body) + size > limit:
            raise H1Error(self.over, f"request body is larger than {limit} bytes")
        if self._wire > 2 * limit + MAX_HEAD:
            raise H1Error(self.over, "chunked framing much larger than the body limit")

    def _trailer(self, data: bytes, pos: int) -> bool:
        # After the zero-size chunk: trailer fields (usually none) up to an empty line.
        n = len(data)
        while True:
            nl = data.find(b"\r\n", pos)
            if nl < 0:
                if self._trailer_bytes + n - pos > MAX_HEAD:
                    raise H1Error(self.big, "trailers too large")
                self.partial = data[pos:]
                return False
            if nl == pos:
                self.done = True
                self.rest = data[nl + 2 :]
                return True
            self._trailer_bytes += nl + 2 - pos
            if self._trailer_bytes > MAX_HEAD:
                raise H1Error(self.big, "trailers too large")
            if self.strict:
                line = data[pos:nl]
                name, sep, _ = line.partition(b":")
                if not sep or not TOKEN.fullmatch(name) or bad_controls(line):
                    raise H1Error(self.status, f"bad trailer line {show(line)}")
                self._trailers += 1
                if self._trailers > MAX_FIELDS:
                    raise H1Error(self.big, f"more than {MAX_FIELDS} trailer fields")
            pos = nl + 2


def dechunk(raw: bytes, status: int = 502) -> bytes:
    """The payload of a whole chunked body (trailers ignored). Raises H1Error."""
    reader = ChunkedReader(status, keep=True)
    _, done = reader.feed(raw)
    if not done:
        raise H1Error(status, "truncated chunked body")
    assert reader.body is not None
    return bytes(reader.body)

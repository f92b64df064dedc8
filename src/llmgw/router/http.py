"""The server side of HTTP/1.1: a lean request reader over a plain socket, keep-alive,
a body limit.

One `ClientConn` per accepted connection. `next_request` returns the next request with its
whole body (bounded by `max_body`; over it raises TooLarge before reading the rest), or
None when the client is gone or the connection cannot be reused. Malformed requests raise
BadRequest. h11 did this job first; it was a fifth of the router's CPU per request (see
bench/README.md), so the parser is this small hand-written one, strict where it matters
for a proxy: one request line `METHOD SP target SP HTTP/1.x`, token header names (no
whitespace before the colon, no obsolete line folding), no control characters, a single
Content-Length made of digits, Transfer-Encoding only `chunked` and never together with
Content-Length. `Expect: 100-continue` is answered before the body is read.

Responses are built here as bytes (status line, headers, `connection: close` when the
connection will not be reused) and sent with `sockio.send_all`.
"""

from __future__ import annotations

import logging
import re
import socket
from http import HTTPStatus

import trio
from trio.lowlevel import Abort, Task, current_task, reschedule, wait_task_rescheduled

from llmgw.router import sockio
from llmgw.router.sockio import RECV

__all__ = ["BadRequest", "ClientConn", "Request", "TooLarge"]

MAX_HEAD = 65536
INBOX_MAX = 1 << 20
_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
# Control characters other than tab, and CR or LF that are not a CRLF pair.
_CTL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n)|(?<!\r)\n")
_REASON = {int(s): s.phrase.encode() for s in HTTPStatus}

log = logging.getLogger(__name__)


class TooLarge(Exception):
    pass


class BadRequest(Exception):
    pass


class Request:
    __slots__ = ("method", "target", "headers", "body")

    def __init__(self, method: bytes, target: bytes, headers: dict[bytes, bytes], body: bytes) -> None:
        self.method = method
        self.target = target
        self.headers = headers  # lower-case name → value (a repeated header: the last)
        self.body = body

    def header(self, name: bytes) -> bytes | None:
        return self.headers.get(name)


class ClientConn:
    """One client connection. A reader task (`read_loop`, started by the service next to
    the request loop) owns every receive on the socket: it hands the bytes to the request
    parser through `inbox`, and while a request is being served it is what notices the
    client closing (it cancels `watch`, the scope of that request), so no task is started
    per request to watch for that. It stops reading while `inbox` holds more than
    INBOX_MAX bytes nobody asked for."""

    __slots__ = (
        "sock",
        "buf",
        "inbox",
        "eof",
        "waiter",
        "waiting_since",
        "reader_parked",
        "watch",
        "max_body",
        "idle",
        "keep_alive",
        "http10",
        "responded",
    )

    def __init__(self, sock: socket.socket, max_body: int, idle: float = 60.0) -> None:
        self.sock = sock
        self.buf = b""  # taken from the inbox, not yet parsed (the request loop's own)
        self.inbox = b""  # received by the reader, not yet taken
        self.eof = False  # the client closed (or broke) the connection
        self.waiter: Task | None = None  # the request loop, waiting for bytes
        self.waiting_since = trio.current_time()  # when it last began waiting
        self.reader_parked: Task | None = None  # the reader, waiting for room in the inbox
        self.watch: trio.CancelScope | None = None  # the request being served
        self.max_body = max_body
        self.idle = idle
        self.keep_alive = True
        self.http10 = False
        self.responded = False  # a response head went out for the current request

    async def read_loop(self) -> None:
        # The idle timeout (a client that sends nothing for `idle` seconds while its next
        # request, or the rest of one, is awaited) is kept here too, so that waiting for a
        # request costs no cancel scope: this loop's scope is made again only when its
        # deadline passes, and then checks whether the request loop has really been
        # waiting that long (`waiting_since`, set when it parks).
        sock = self.sock
        try:
            while True:
                with trio.CancelScope(deadline=self.waiting_since + self.idle) as scope:
                    while True:
                        if len(self.inbox) > INBOX_MAX:
                            self.reader_parked = current_task()
                            await wait_task_rescheduled(self._abort_reader)
                            continue
                        data = await sockio.recv(sock)
                        if not data:
                            break
                        self.inbox += data
                        if self.waiter is not None:
                            reschedule(self.waiter)
                            self.waiter = None
                if not scope.cancelled_caught:
                    break  # EOF
                if self.waiter is not None and trio.current_time() >= self.waiting_since + self.idle:
                    break  # idle: treated as the client gone
                if self.waiter is None:
                    self.waiting_since = trio.current_time()  # busy serving: look again later
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.debug("client connection ended: %s", exc)  # the same as EOF for us
        self.eof = True
        if self.waiter is not None:
            reschedule(self.waiter)
            self.waiter = None
        if self.watch is not None:
            self.watch.cancel()

    def _abort_reader(self, _: object) -> Abort:
        self.reader_parked = None
        return Abort.SUCCEEDED

    def _abort_wait(self, _: object) -> Abort:
        self.waiter = None
        return Abort.SUCCEEDED

    async def _more(self) -> bytes:
        """The next bytes from the client; b"" at EOF or after `idle` seconds of nothing
        (the reader sets `eof` then)."""
        if not self.inbox and not self.eof:
            self.waiting_since = trio.current_time()
            self.waiter = current_task()
            await wait_task_rescheduled(self._abort_wait)
        data, self.inbox = self.inbox, b""
        if self.reader_parked is not None:
            reschedule(self.reader_parked)
            self.reader_parked = None
        return data

    async def next_request(self) -> Request | None:
        if not self.keep_alive:
            return None
        self.responded = False
        buf = self.buf
        if self.inbox:
            buf += self.inbox
            self.inbox = b""
        if buf[:2] == b"\r\n":
            buf = buf.lstrip(b"\r\n")  # empty lines before a request are allowed
        end = buf.find(b"\r\n\r\n")
        while end < 0:
            if len(buf) > MAX_HEAD:
                raise BadRequest("request head too large")
            data = await self._more()
            if not data:
                return None
            buf = (buf + data).lstrip(b"\r\n") if not buf else buf + data
            end = buf.find(b"\r\n\r\n", max(0, len(buf) - len(data) - 3))
        head = buf[:end]
        buf = buf[end + 4 :]
        lines = head.split(b"\r\n")
        if _CTL.search(head):
            raise BadRequest("control character in the request head")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not parts[1]:
            raise BadRequest(f"bad request line {lines[0][:80]!r}")
        method, target, version = parts
        if version == b"HTTP/1.1":
            http10 = False
        elif version == b"HTTP/1.0":
            http10 = True
        else:
            raise BadRequest(f"unsupported HTTP version {version[:20]!r}")
        headers: dict[bytes, bytes] = {}
        length = -1
        chunked = False
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not _TOKEN.fullmatch(name):
                raise BadRequest(f"bad header line {line[:80]!r}")
            name = name.lower()
            value = value.strip(b" \t")
            if name == b"content-length":
                if not value.isdigit() or (length >= 0 and int(value) != length):
                    raise BadRequest(f"bad content-length {value[:40]!r}")
                length = int(value)
            elif name == b"transfer-encoding":
                if value.lower() != b"chunked" or chunked:
                    raise BadRequest(f"unsupported transfer-encoding {value[:40]!r}")
                chunked = True
            headers[name] = value
        if chunked and length >= 0:
            raise BadRequest("both content-length and transfer-encoding")
        conn = headers.get(b"connection")
        if conn is None:
            keep_alive = not http10
        else:
            tokens = {t.strip() for t in conn.lower().split(b",")}
            keep_alive = b"close" not in tokens and (not http10 or b"keep-alive" in tokens)
        self.http10 = http10
        self.keep_alive = keep_alive
        if length > 0:
            if length > self.max_body:
                self.buf = b""
                raise TooLarge()
            if len(buf) < length:
                await self._continue(headers, http10)
                parts_: list[bytes] = [buf]
                have = len(buf)
                while have < length:
                    more = await self._more_or_none()
                    if more is None:
                        return None
                    parts_.append(more)
                    have += len(more)
                buf = b"".join(parts_)
            body, buf = buf[:length], buf[length:]
        elif chunked:
            await self._continue(headers, http10)
            got = await self._chunked_body(buf)
            if got is None:
                return None
            body, buf = got
        else:
            body = b""
        self.buf = buf
        return Request(method, target, headers, body)

    async def _more_or_none(self) -> bytes | None:
        return await self._more() or None

    async def _continue(self, headers: dict[bytes, bytes], http10: bool) -> None:
        if not http10 and headers.get(b"expect", b"").lower() == b"100-continue":
            await sockio.send_all(self.sock, b"HTTP/1.1 100 Continue\r\n\r\n")

    async def _chunked_body(self, buf: bytes) -> tuple[bytes, bytes] | None:
        out: list[bytes] = []
        size_total = 0
        pos = 0
        while True:
            nl = buf.find(b"\r\n", pos)
            while nl < 0:
                if len(buf) - pos > 1024:
                    raise BadRequest("chunk size line too long")
                data = await self._more_or_none()
                if data is None:
                    return None
                buf += data
                nl = buf.find(b"\r\n", pos)
            size_s = buf[pos:nl].split(b";", 1)[0].strip()
            try:
                size = int(size_s, 16)
            except ValueError:
                raise BadRequest(f"bad chunk size {size_s[:40]!r}") from None
            if size < 0:
                raise BadRequest("bad chunk size")
            pos = nl + 2
            if size == 0:
                # Trailers (ignored) up to an empty line.
                while True:
                    nl = buf.find(b"\r\n", pos)
                    while nl < 0:
                        if len(buf) - pos > MAX_HEAD:
                            raise BadRequest("trailers too large")
                        data = await self._more_or_none()
                        if data is None:
                            return None
                        buf += data
                        nl = buf.find(b"\r\n", pos)
                    line_empty = nl == pos
                    pos = nl + 2
                    if line_empty:
                        return b"".join(out), buf[pos:]
            size_total += size
            if size_total > self.max_body:
                self.buf = b""
                raise TooLarge()
            while len(buf) < pos + size + 2:
                data = await self._more_or_none()
                if data is None:
                    return None
                buf += data
            if buf[pos + size : pos + size + 2] != b"\r\n":
                raise BadRequest("chunk data not followed by CRLF")
            out.append(buf[pos : pos + size])
            pos += size + 2
            if pos > RECV:  # keep the buffer from growing with the consumed part
                buf = buf[pos:]
                pos = 0

    def head(self, status: int, headers: bytes) -> bytes:
        """A response head; `headers` are ready-made `name: value\\r\\n` lines."""
        self.responded = True
        return b"HTTP/1.1 %d %s\r\n%s%s\r\n" % (
            status,
            _REASON.get(status, b""),
            headers,
            b"" if self.keep_alive else b"connection: close\r\n",
        )

    async def send(self, data: bytes) -> None:
        await sockio.send_all(self.sock, data)

    async def respond(self, status: int, content_type: bytes, body: bytes, close: bool = False) -> None:
        if close:
            self.keep_alive = False
        head = self.head(status, b"content-type: %s\r\ncontent-length: %d\r\n" % (content_type, len(body)))
        await sockio.send_all(self.sock, head + body)

    @property
    def can_respond(self) -> bool:
        return not self.responded

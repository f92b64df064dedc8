"""The server side of HTTP/1.1, the trio shell: reads bytes, hands them to the sans-IO
request parser (`llmgw.http1.request.RequestParser`, where every rule lives), sends
responses.

One `ClientConn` per accepted connection. `next_request` returns the next request with its
whole body, or None when the client is gone or the connection cannot be reused; a request
that breaks the rules raises `H1Error` with the status to answer. `Expect:
100-continue` is answered before the body is read. The head of a request must be all
here within `header_timeout` (counted from the connection for the first request, from
its first byte for later ones): else H1Error(408).

Responses are built here as bytes (status line, headers, `connection: close` when the
connection will not be reused) and sent with `sockio.send_all`.
"""

from __future__ import annotations

import logging
import math
import socket
from http import HTTPStatus

import trio
from trio.lowlevel import Abort, Task, current_task, reschedule, wait_task_rescheduled

from llmgw.http1.grammar import H1Error
from llmgw.http1.request import Request, RequestParser
from llmgw.router.connection import sockio

__all__ = ["ClientConn", "H1Error", "Request"]

INBOX_MAX = 1 << 20
_REASON = {int(s): s.phrase.encode() for s in HTTPStatus}
# Ready-made status lines, so that a response head is one formatting operation.
_STATUS_LINE = {code: b"HTTP/1.1 %d %s\r\n" % (code, phrase) for code, phrase in _REASON.items()}

log = logging.getLogger(__name__)


class ClientConn:
    """One client connection. A reader task (`read_loop`, started by the service next to
    the request loop) owns every receive on the socket: it hands the bytes to the request
    parser through `inbox`, and while a request is being served it is what notices the
    client closing (it cancels `watch`, the scope of that request), so no task is started
    per request to watch for that. It stops reading while `inbox` holds more than
    INBOX_MAX bytes nobody asked for."""

    __slots__ = (
        "sock",
        "parser",
        "inbox",
        "eof",
        "waiter",
        "waiting_since",
        "reader_parked",
        "reader_scope",
        "watch",
        "idle",
        "header_timeout",
        "head_deadline",
        "head_timed_out",
        "idled_out",
        "keep_alive",
        "http10",
        "responded",
    )

    def __init__(
        self, sock: socket.socket, max_body: int, idle: float = 60.0, header_timeout: float = 10.0
    ) -> None:
        self.sock = sock
        self.parser = RequestParser(max_body)
        self.inbox = b""  # received by the reader, not yet taken
        self.eof = False  # the client closed (or broke) the connection
        self.waiter: Task | None = None  # the request loop, waiting for bytes
        self.waiting_since = trio.current_time()  # when it last began waiting
        self.reader_parked: Task | None = None  # the reader, waiting for room in the inbox
        self.reader_scope: trio.CancelScope | None = None
        self.watch: trio.CancelScope | None = None  # the request being served
        self.idle = idle
        self.header_timeout = header_timeout
        # When the head being read must be complete (inf: no head being read). The first
        # request's clock starts with the connection.
        self.head_deadline = self.waiting_since + header_timeout
        self.head_timed_out = False
        self.idled_out = False
        self.keep_alive = True
        self.http10 = False
        self.responded = False  # a response head went out for the current request

    async def read_loop(self) -> None:
        # The idle timeout (a client that sends nothing for `idle` seconds while its next
        # request, or the rest of one, is awaited) and the head deadline are kept here, so
        # that waiting for a request costs no cancel scope: this loop's scope is made again
        # only when its deadline passes, and then checks whether the request loop has really
        # been waiting that long (`waiting_since`, set when it parks) or the head is late.
        sock = self.sock
        try:
            while True:
                deadline = min(self.waiting_since + self.idle, self.head_deadline)
                with trio.CancelScope(deadline=deadline) as scope:
                    self.reader_scope = scope
                    got = False
                    while True:
                        if len(self.inbox) > INBOX_MAX:
                            self.reader_parked = current_task()
                            await wait_task_rescheduled(self._abort_reader)
                            continue
                        # After bytes came, the client mostly has nothing more to send
                        # until it is answered: wait first rather than try (EAGAIN).
                        data = await (sockio.recv_next(sock) if got else sockio.recv(sock))
                        if not data:
                            break
                        got = True
                        self.inbox += data
                        if self.waiter is not None:
                            reschedule(self.waiter)
                            self.waiter = None
                self.reader_scope = None
                if not scope.cancelled_caught:
                    break  # EOF
                now = trio.current_time()
                if now >= self.head_deadline:
                    self.head_timed_out = True  # the request loop answers 408
                    break
                if self.waiter is not None and now >= self.waiting_since + self.idle:
                    self.idled_out = True
                    break  # idle: treated as the client gone
                if self.waiter is None:
                    self.waiting_since = now  # busy serving: look again later
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
        """The next bytes from the client; b"" at EOF, after `idle` seconds of nothing or
        when the head deadline passed (the reader sets `eof` then)."""
        if not self.inbox and not self.eof:
            self.waiting_since = trio.current_time()
            self.waiter = current_task()
            await wait_task_rescheduled(self._abort_wait)
        data, self.inbox = self.inbox, b""
        if self.reader_parked is not None:
            reschedule(self.reader_parked)
            self.reader_parked = None
        return data

    def _arm_head_deadline(self) -> None:
        self.head_deadline = d = trio.current_time() + self.header_timeout
        scope = self.reader_scope
        if scope is not None and d < scope.deadline:
            scope.deadline = d

    async def next_request(self) -> Request | None:
        """The next request, or None (client gone, or the connection is not reused).
        Raises H1Error for a request that breaks the rules or a head that came too late."""
        if not self.keep_alive:
            return None
        self.responded = False
        p = self.parser
        if self.inbox:
            p.feed(self.inbox)
            self.inbox = b""
        while True:
            req = p.next()
            if req is not None:
                self.head_deadline = math.inf
                self.http10 = req.http10
                self.keep_alive = req.keep_alive
                return req
            if p.in_head:
                if self.head_deadline == math.inf:
                    self._arm_head_deadline()
            elif p.state:  # the head is in, its body is not
                self.head_deadline = math.inf
                if p.continue_wanted:
                    p.continue_wanted = False
                    await sockio.send_all(self.sock, b"HTTP/1.1 100 Continue\r\n\r\n")
            data = await self._more()
            if not data:
                if self.head_timed_out:
                    raise H1Error(408, f"the request head did not arrive within {self.header_timeout:g}s")
                if (p.in_head or p.state) and not self.idled_out:
                    # The client ended its half of the connection inside a request.
                    raise H1Error(400, "the connection ended in the middle of a request")
                return None
            p.feed(data)

    def head(self, status: int, headers: bytes) -> bytes:
        """A response head; `headers` are ready-made `name: value\\r\\n` lines."""
        self.responded = True
        line = _STATUS_LINE.get(status)
        if line is None:
            line = b"HTTP/1.1 %d \r\n" % status
        if self.keep_alive:
            return line + headers + b"\r\n"
        return line + headers + b"connection: close\r\n\r\n"

    async def send(self, data: bytes) -> None:
        await sockio.send_all(self.sock, data)

    async def respond(self, status: int, content_type: bytes, body: bytes, close: bool = False,
                      extra: bytes = b"") -> None:
        """`extra`: further ready-made header lines (`name: value\r\n`)."""
        if close:
            self.keep_alive = False
        head = self.head(status, b"content-type: %s\r\ncontent-length: %d\r\n%s" % (
            content_type, len(body), extra))
        await sockio.send_all(self.sock, head + body)

    @property
    def can_respond(self) -> bool:
        return not self.responded

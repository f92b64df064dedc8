"""The small read-only HTTP listener, the trio shell: the server's and the agent's
/metrics (and the server's status page), GET and HEAD, one request per connection.

The request is read by the sans-IO parser (`llmgw.http1.request`: strict RFC 9112,
bounded head, no body accepted) within `header_timeout`; routing, the token check and
the answer's bytes are pure (`llmgw.http1.listen`); this only reads, answers and closes.
Whatever one connection does costs that connection: a handler's exception is logged and
answered 500. Connections are bounded: past `max_connections` a new one is closed
unanswered.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import trio

from llmgw.config.metrics import split_host_port
from llmgw.errors import LlmgwError
from llmgw.http1.grammar import H1Error
from llmgw.http1.listen import BadTarget, HttpRequest, Response, Route, dispatch, parse_target, plain, render
from llmgw.http1.request import RequestParser
from llmgw.logbound import Throttle

log = logging.getLogger(__name__)

HEADER_TIMEOUT = 10.0  # seconds for a request head to arrive, whole
WRITE_TIMEOUT = 30.0  # seconds to hand over an answer (a scrape of a large cluster)
MAX_CONNECTIONS = 64


async def _read_request(stream: trio.abc.Stream) -> HttpRequest | Response | None:
    """The request, an answer to a bad one, or None (the peer left)."""
    parser = RequestParser(max_body=0)
    while True:
        try:
            req = parser.next()
        except H1Error as exc:
            return plain(exc.status, exc.message)
        if req is not None:
            break
        data = await stream.receive_some(16384)
        if not data:
            return None
        parser.feed(bytes(data))
    try:
        path, query = parse_target(req.target)
    except BadTarget as exc:
        return plain(400, str(exc))
    return HttpRequest(req.method.decode("ascii", "replace"), path, query, req.headers)


class _Listener:
    def __init__(self, routes: Mapping[str, Route], token: str, name: str, header_timeout: float,
                 max_connections: int) -> None:
        self.routes = routes
        self.token = token
        self.name = name
        self.header_timeout = header_timeout
        self.slots = trio.CapacityLimiter(max_connections)
        self.throttle = Throttle()

    async def connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                self.slots.acquire_nowait()
            except trio.WouldBlock:
                self.throttle.log(log, logging.WARNING, "full", "%s: too many connections; closed one",
                                  self.name)
                return
            try:
                await self._serve_one(stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                log.debug("%s: connection ended: %s", self.name, exc)
            except Exception:
                # A bug of ours costs this connection, never the daemon.
                self.throttle.bug(log, "bug", "%s: a request failed", self.name)
            finally:
                self.slots.release()

    async def _serve_one(self, stream: trio.SocketStream) -> None:
        got: HttpRequest | Response | None = None
        with trio.move_on_after(self.header_timeout):
            got = await _read_request(stream)
            if got is None:
                return
        if got is None:
            got = plain(408, f"no whole request within {self.header_timeout:g}s")
        head_only = isinstance(got, HttpRequest) and got.method == "HEAD"
        if isinstance(got, HttpRequest):
            handler = dispatch(got, self.routes, self.token)
            if isinstance(handler, Response):
                resp = handler
            else:
                try:
                    resp = await handler(got)
                except Exception:
                    self.throttle.bug(log, "handler", "%s: %s failed", self.name, got.path)
                    resp = plain(500, "internal error; see the daemon's log")
        else:
            resp = got
        with trio.move_on_after(WRITE_TIMEOUT):
            await stream.send_all(render(resp, head_only=head_only))


class BindError(LlmgwError):
    """The listener's address is taken or not ours: a configuration to fix."""

    exit_code = 2


async def serve_http(
    bind: str,
    routes: Mapping[str, Route],
    *,
    token: str = "",
    name: str = "metrics",
    header_timeout: float = HEADER_TIMEOUT,
    max_connections: int = MAX_CONNECTIONS,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer `routes` on `bind` (host:port; port 0 picks one) until cancelled.
    `task_status.started` gets the bound `host:port`."""
    host, port = split_host_port(bind)
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise BindError(f"cannot listen on {bind} ({name}): {exc.strerror or exc}") from None
    sockname = listeners[0].socket.getsockname()
    bound = f"[{sockname[0]}]:{sockname[1]}" if ":" in sockname[0] else f"{sockname[0]}:{sockname[1]}"
    listener = _Listener(routes, token, name, header_timeout, max_connections)
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, listener.connection, listeners)  # it closes them
        log.info("%s: http://%s/", name, bound)
        task_status.started(bound)

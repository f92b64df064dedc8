"""A small read-only HTTP listener for the server's and the agent's /metrics (and the
server's status page): GET and HEAD, one request per connection.

The request is read by the router's sans-IO parser (strict RFC 9112, bounded head, no
body accepted) within `header_timeout`; routing and the token check are pure functions
of the request; the trio shell below only reads, answers and closes. Whatever one
connection does costs that connection: a handler's exception is logged and answered 500.
Connections are bounded: past `max_connections` a new one is closed unanswered.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from urllib.parse import parse_qsl, unquote

import trio
from attrs import field, frozen

from llmgw.config.metrics import split_host_port
from llmgw.errors import LlmgwError
from llmgw.logbound import Throttle
from llmgw.router.h1 import H1Error, RequestParser

log = logging.getLogger(__name__)

HEADER_TIMEOUT = 10.0  # seconds for a request head to arrive, whole
WRITE_TIMEOUT = 30.0  # seconds to hand over an answer (a scrape of a large cluster)
MAX_CONNECTIONS = 64
MAX_TARGET = 2048  # bytes of a request target: paths here are short


@frozen
class HttpRequest:
    method: str
    path: str
    query: Mapping[str, str]
    headers: Mapping[bytes, bytes]  # lower-case names


@frozen
class Response:
    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = field(default=())


Handler = Callable[[HttpRequest], Awaitable[Response]]


@frozen
class Route:
    handler: Handler
    # Whether the token (when one is set) is asked for: static files of the page hold
    # nothing of the cluster and a browser cannot add a header to a <script src>.
    private: bool = True


class BadTarget(LlmgwError):
    pass


def parse_target(target: bytes) -> tuple[str, dict[str, str]]:
    """Origin-form `/path?query` -> (decoded path, query). Raises BadTarget."""
    if len(target) > MAX_TARGET:
        raise BadTarget(f"request target over {MAX_TARGET} bytes")
    if not target.startswith(b"/"):
        raise BadTarget("request target is not a path")
    try:
        text = target.decode("ascii")
    except UnicodeDecodeError:
        raise BadTarget("request target is not ASCII") from None
    raw_path, _, raw_query = text.partition("?")
    path = unquote(raw_path)
    if "\x00" in path or any(part == ".." for part in path.split("/")):
        raise BadTarget("request target is not a plain path")
    query: dict[str, str] = {}
    for k, v in parse_qsl(raw_query, keep_blank_values=True, max_num_fields=32):
        query.setdefault(k, v)  # the first wins: one value per name
    return path, query


def authorized(req: HttpRequest, token: str) -> bool:
    """No token set: everyone (the listener is on loopback). Else `Authorization: Bearer
    TOKEN` or `?token=TOKEN`, compared in constant time."""
    if not token:
        return True
    want = token.encode()
    auth = req.headers.get(b"authorization", b"")
    scheme, _, given = auth.partition(b" ")
    if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), want):
        return True
    return hmac.compare_digest(req.query.get("token", "").encode(), want)


def plain(status: int, text: str = "") -> Response:
    return Response(status, (text or HTTPStatus(status).phrase).encode() + b"\n")


def dispatch(req: HttpRequest, routes: Mapping[str, Route], token: str) -> Handler | Response:
    """The handler for `req`, or the answer when there is none to call. Pure."""
    route = routes.get(req.path)
    if route is None:
        return plain(404, "not found; try " + ", ".join(sorted(routes)))
    if req.method not in ("GET", "HEAD"):
        return Response(405, b"only GET and HEAD\n", headers=(("Allow", "GET, HEAD"),))
    if route.private and not authorized(req, token):
        return Response(401, b"a token is required: Authorization: Bearer TOKEN, or ?token=TOKEN\n",
                        headers=(("WWW-Authenticate", 'Bearer realm="llmgw"'),))
    return route.handler


SECURITY_HEADERS = (
    ("X-Content-Type-Options", "nosniff"),
    # The page's address may carry the token: never hand it to another site.
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
)


def render(resp: Response, *, head_only: bool = False) -> bytes:
    """The whole answer, with `Connection: close`. Pure."""
    try:
        reason = HTTPStatus(resp.status).phrase
    except ValueError:
        reason = "Unknown"
    lines = [
        f"HTTP/1.1 {resp.status} {reason}",
        f"Content-Type: {resp.content_type}",
        f"Content-Length: {len(resp.body)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in (*SECURITY_HEADERS, *resp.headers)),
    ]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + resp.body


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
                self.throttle.log(log, logging.ERROR, "bug", "%s: a request failed", self.name,
                                  exc_info=True)
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
                    self.throttle.log(log, logging.ERROR, "handler", "%s: %s failed", self.name,
                                      got.path, exc_info=True)
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

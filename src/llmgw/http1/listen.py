"""The small read-only HTTP listener's pure part: the request it accepts, routing, the
token check and the answer's bytes (the trio shell is `llmgw.http1.serve`).

GET and HEAD, one request per connection, for the server's and the agent's /metrics
(and the server's status page).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from urllib.parse import parse_qsl, unquote

from attrs import field, frozen

from llmgw.errors import LlmgwError

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



"""The metrics/status listener: pure parsing, routing and token check; the trio shell on a
real loopback socket (timeouts on trio's autojump clock)."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from llmgw.http1.listen import (
    MAX_TARGET,
    BadTarget,
    HttpRequest,
    Response,
    Route,
    authorized,
    dispatch,
    parse_target,
    render,
)
from llmgw.http1.serve import BindError, serve_http

TOKEN = "s3cret-token-0123456789"


def req(path: str = "/metrics", method: str = "GET", query: dict[str, str] | None = None,
        headers: dict[bytes, bytes] | None = None) -> HttpRequest:
    return HttpRequest(method, path, query or {}, headers or {})


async def hello(r: HttpRequest) -> Response:
    return Response(200, f"hello {r.query.get('who', '')}".encode())


async def boom(r: HttpRequest) -> Response:
    raise RuntimeError("a bug")


ROUTES = {"/metrics": Route(hello), "/static/app.js": Route(hello, private=False), "/boom": Route(boom)}


# ---- pure ----


def test_parse_target() -> None:
    assert parse_target(b"/metrics") == ("/metrics", {})
    assert parse_target(b"/?token=abc&x=1&token=other") == ("/", {"token": "abc", "x": "1"})
    assert parse_target(b"/status%2Ejson") == ("/status.json", {})
    for bad in (b"http://x/metrics", b"*", b"/../etc/passwd", b"/a/%2e%2e/b", b"/%00", b"/\xff",
                b"/" + b"a" * MAX_TARGET):
        with pytest.raises(BadTarget):
            parse_target(bad)


@given(st.binary(max_size=300))
def test_parse_target_is_total(raw: bytes) -> None:
    try:
        path, query = parse_target(raw)
    except BadTarget:
        return
    assert path.startswith("/") and ".." not in path.split("/")
    assert all(isinstance(v, str) for v in query.values())


def test_token() -> None:
    assert authorized(req(), "")
    assert not authorized(req(), TOKEN)
    assert authorized(req(headers={b"authorization": f"Bearer {TOKEN}".encode()}), TOKEN)
    assert authorized(req(headers={b"authorization": f"bearer  {TOKEN}".encode()}), TOKEN)
    assert not authorized(req(headers={b"authorization": f"Basic {TOKEN}".encode()}), TOKEN)
    assert not authorized(req(headers={b"authorization": b"Bearer " + TOKEN[:-1].encode()}), TOKEN)
    assert authorized(req(query={"token": TOKEN}), TOKEN)
    assert not authorized(req(query={"token": TOKEN + "x"}), TOKEN)


def test_dispatch() -> None:
    assert dispatch(req(), ROUTES, "") is hello
    missing = dispatch(req("/nope"), ROUTES, "")
    assert isinstance(missing, Response) and missing.status == 404
    post = dispatch(req(method="POST"), ROUTES, "")
    assert isinstance(post, Response) and post.status == 405
    denied = dispatch(req(), ROUTES, TOKEN)
    assert isinstance(denied, Response) and denied.status == 401
    # The page's static files carry nothing of the cluster: no token asked.
    assert dispatch(req("/static/app.js"), ROUTES, TOKEN) is hello


def test_render() -> None:
    raw = render(Response(200, b"abc", "text/html"))
    head, body = raw.split(b"\r\n\r\n")
    assert body == b"abc"
    assert b"Content-Length: 3" in head and b"Connection: close" in head
    assert b"Referrer-Policy: no-referrer" in head
    assert render(Response(200, b"abc"), head_only=True).endswith(b"\r\n\r\n")


# ---- the shell, on a real socket ----


async def exchange(addr: str, data: bytes) -> bytes:
    host, _, port = addr.rpartition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        if data:
            await stream.send_all(data)
        got = b""
        while True:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return got
            got += chunk


async def test_listener_answers(nursery: trio.Nursery) -> None:
    addr = await nursery.start(serve_http, "127.0.0.1:0", ROUTES)
    ok = await exchange(addr, b"GET /metrics?who=you HTTP/1.1\r\nHost: x\r\n\r\n")
    assert ok.startswith(b"HTTP/1.1 200 ") and ok.endswith(b"hello you")
    head = await exchange(addr, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")
    assert (await exchange(addr, b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")).startswith(b"HTTP/1.1 404 ")
    assert (await exchange(addr, b"garbage\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
    body = b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
    assert (await exchange(addr, body)).startswith(b"HTTP/1.1 413 ")
    huge = b"GET /metrics HTTP/1.1\r\n" + b"X-A: " + b"a" * 70000 + b"\r\n\r\n"
    assert (await exchange(addr, huge)).startswith(b"HTTP/1.1 431 ")
    # A handler's bug costs that request: 500, and the listener goes on.
    assert (await exchange(addr, b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")).startswith(b"HTTP/1.1 500 ")
    assert (await exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")).startswith(b"HTTP/1.1 200 ")


async def test_listener_token(nursery: trio.Nursery) -> None:
    addr = await nursery.start(lambda task_status: serve_http("127.0.0.1:0", ROUTES, token=TOKEN,
                                                              task_status=task_status))
    assert (await exchange(addr, b"GET /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 401 ")
    auth = f"GET /metrics HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
    assert (await exchange(addr, auth)).startswith(b"HTTP/1.1 200 ")
    query = f"GET /metrics?token={TOKEN} HTTP/1.1\r\n\r\n".encode()
    assert (await exchange(addr, query)).startswith(b"HTTP/1.1 200 ")


async def test_slow_head_gets_408(nursery: trio.Nursery, autojump_clock: trio.testing.MockClock) -> None:
    addr = await nursery.start(serve_http, "127.0.0.1:0", ROUTES)
    started = trio.current_time()
    got = await exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
    assert got.startswith(b"HTTP/1.1 408 ")
    assert trio.current_time() - started >= 10.0


async def test_connections_are_bounded(nursery: trio.Nursery, autojump_clock: trio.testing.MockClock) -> None:
    addr = await nursery.start(lambda task_status: serve_http("127.0.0.1:0", ROUTES, max_connections=2,
                                                              task_status=task_status))
    host, _, port = addr.rpartition(":")
    idle = [await trio.open_tcp_stream(host, int(port)) for _ in range(2)]
    try:
        await trio.sleep(0.1)  # both accepted, each holding a slot while its head is awaited
        # A third is closed unanswered while both slots are held.
        assert await exchange(addr, b"GET /metrics HTTP/1.1\r\n\r\n") == b""
    finally:
        for s in idle:
            await s.aclose()
    await trio.sleep(0.1)
    assert (await exchange(addr, b"GET /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 200 ")


async def test_port_taken_is_one_line() -> None:
    async with trio.open_nursery() as nursery:
        addr = await nursery.start(serve_http, "127.0.0.1:0", ROUTES)
        with pytest.raises(BindError) as info:
            await serve_http(addr, ROUTES)
        assert addr in str(info.value) and info.value.exit_code == 2
        nursery.cancel_scope.cancel()

"""The per-connection guard: an unexpected error in a handler is answered 500 (when no
response head went out), logged, counted, and the listener goes on accepting."""

from __future__ import annotations

import logging

import pytest
import trio

from llmgw.config.router import RouterConfig, RouterKeysConfig
from llmgw.http1.request import Request
from llmgw.router.connection.http import ClientConn
from llmgw.router.front import Router


async def exchange(port: int, data: bytes) -> bytes:
    s = await trio.open_tcp_stream("127.0.0.1", port)
    async with s:
        await s.send_all(data)
        out = b""
        with trio.fail_after(5):
            while chunk := await s.receive_some(65536):
                out += chunk
        return out


async def test_handler_error_is_500_and_the_listener_lives(caplog: pytest.LogCaptureFixture) -> None:
    router = Router(RouterConfig(server="tcp://127.0.0.1:1", keys=RouterKeysConfig("", "")))

    async def broken(client: ClientConn, req: Request) -> None:
        raise ValueError("a bug " + "x" * 10_000)

    router.dispatch = broken  # type: ignore[method-assign]
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, router.handle, listeners)
        for _ in range(8):
            got = await exchange(port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert got.startswith(b"HTTP/1.1 500 "), got
            assert b"connection: close" in got and b'"code": "internal_error"' in got
        nursery.cancel_scope.cancel()
    assert router.metrics.handler_errors == 8
    assert b"llmgw_router_handler_errors_total 8.0" in router.metrics.render()
    lines = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert 1 <= len(lines) <= 5  # throttled: five, then one a minute
    assert all(len(r.getMessage()) < 3000 for r in lines)  # clipped
    assert "ValueError" in lines[0].getMessage()


async def test_client_reset_mid_answer_is_not_a_bug() -> None:
    router = Router(RouterConfig(server="tcp://127.0.0.1:1", keys=RouterKeysConfig("", "")))

    async def gone(client: ClientConn, req: Request) -> None:
        raise trio.BrokenResourceError("client went away")

    router.dispatch = gone  # type: ignore[method-assign]
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, router.handle, listeners)
        assert await exchange(port, b"GET /health HTTP/1.1\r\n\r\n") == b""
        got = await exchange(port, b"GET /health HTTP/1.1\r\ncontent-length: " + b"7" * 5000 + b"\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 413 ")
        nursery.cancel_scope.cancel()
    assert router.metrics.handler_errors == 0

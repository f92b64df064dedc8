"""The simulated engine survives any client going away (issue 20, item 3).

In-process: one connection served over a Unix socket pair, the client end steered to
go away at each point (mid-metrics, mid-stream, mid-head); serve_connection must return
quietly, not raise. A closed or read-shut peer makes the engine's next write fail with
EPIPE at once, which is the path that killed the engine: ClientGone raised inside the
handler's nursery came out as an ExceptionGroup past `except ClientGone`.
Then the real process: clients that reset their connection during /metrics, many times.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import trio

from fakes.engines import SimEngineProcess, free_port, vllm_args
from llmgw.simengine.api import SimEngine
from llmgw.simengine.args import parse_args
from llmgw.simengine.http import serve_connection

FAST = {"LLMGW_SIM_TTFT": "0", "LLMGW_SIM_TOKENS_PER_SECOND": "200"}


def _engine() -> SimEngine:
    return SimEngine(parse_args(vllm_args(1), FAST))


def _post(path: str, body: object) -> bytes:
    data = json.dumps(body).encode()
    return b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        path.encode(), len(data), data)


async def _serve_one(server_end: trio.socket.SocketType) -> None:
    """serve_connection must come back by itself, without raising, within 5 s."""
    with trio.fail_after(5):
        await serve_connection(trio.SocketStream(server_end), _engine().handle)


async def test_client_closes_before_metrics_answer() -> None:
    a, b = trio.socket.socketpair()
    with b:
        await b.send(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
    await _serve_one(a)  # the answer's write meets EPIPE: ClientGone, quietly


async def test_client_goes_away_mid_stream() -> None:
    a, b = trio.socket.socketpair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_serve_one, a)
        with b:
            await b.send(_post("/v1/completions", {"prompt": "hi", "stream": True, "max_tokens": 500}))
            got = b""
            while b"data: " not in got:
                got += await b.recv(65536)
            assert got.startswith(b"HTTP/1.1 200")
            # No more reading, but no EOF either: the engine sees no close, only its next
            # token's write failing (EPIPE), inside the handler.
            b.shutdown(socket.SHUT_RD)
            await trio.sleep(0.2)


async def test_client_goes_away_mid_head() -> None:
    a, b = trio.socket.socketpair()
    with b:
        await b.send(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-le")
    await _serve_one(a)


async def test_client_goes_away_mid_body() -> None:
    a, b = trio.socket.socketpair()
    with b:
        await b.send(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"pro")
    await _serve_one(a)


def _reset_during_metrics(port: int) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
    # SO_LINGER 0: close sends RST, so the engine's answer meets ECONNRESET/EPIPE.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()


async def test_engine_process_survives_clients_resetting_mid_metrics(tmp_path: Path) -> None:
    with SimEngineProcess.start(vllm_args(free_port()), FAST, log_dir=tmp_path) as eng:
        await eng.wait_healthy_async()
        for _ in range(200):
            _reset_during_metrics(eng.port)
        await trio.sleep(0.3)
        assert eng.proc.poll() is None, eng.log_text()
        assert eng.health() == 200

"""The simulated engine as a real process on 127.0.0.1."""

from __future__ import annotations

import json
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import h11
import pytest
import trio

from fakes.engines import SimEngineProcess, free_port, vllm_args

FAST = {"LLMGW_SIM_TTFT": "0.01", "LLMGW_SIM_TOKENS_PER_SECOND": "1000"}


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[SimEngineProcess]:
    with SimEngineProcess.start(vllm_args(free_port()), FAST, log_dir=tmp_path) as eng:
        eng.wait_healthy()
        yield eng


async def until(pred: Callable[[], bool], timeout: float) -> None:
    with trio.fail_after(timeout):
        while True:
            if pred():
                return
            await trio.sleep(0.05)


async def _send_request(
    stream: trio.SocketStream, conn: h11.Connection, method: str, path: str, body: Any
) -> None:
    data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    headers = [("host", "127.0.0.1"), ("content-length", str(len(data)))]
    if data:
        headers.append(("content-type", "application/json"))
    out = conn.send(h11.Request(method=method, target=path, headers=headers)) or b""
    out += (conn.send(h11.Data(data=data)) if data else b"") or b""
    out += conn.send(h11.EndOfMessage()) or b""
    await stream.send_all(out)


async def _next(stream: trio.SocketStream, conn: h11.Connection) -> Any:
    while True:
        ev = conn.next_event()
        if ev is not h11.NEED_DATA:
            return ev
        conn.receive_data(await stream.receive_some(65536))


async def request(port: int, method: str, path: str, body: Any = None) -> tuple[int, dict[str, str], bytes]:
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        conn = h11.Connection(h11.CLIENT)
        await _send_request(stream, conn, method, path, body)
        resp = await _next(stream, conn)
        headers = {k.decode(): v.decode() for k, v in resp.headers}
        data = b""
        while True:
            ev = await _next(stream, conn)
            if isinstance(ev, h11.EndOfMessage):
                return resp.status_code, headers, data
            data += ev.data


async def stream_events(port: int, path: str, body: Any) -> list[tuple[float, bytes]]:
    """(arrival time, payload) of each SSE event, the first at the request's send time."""
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        conn = h11.Connection(h11.CLIENT)
        t0 = time.monotonic()
        await _send_request(stream, conn, "POST", path, body)
        resp = await _next(stream, conn)
        assert resp.status_code == 200
        assert dict(resp.headers)[b"content-type"] == b"text/event-stream"
        events: list[tuple[float, bytes]] = []
        buf = b""
        while True:
            ev = await _next(stream, conn)
            if isinstance(ev, h11.EndOfMessage):
                assert buf == b""
                return [(t - t0, p) for t, p in events]
            buf += ev.data
            while b"\n\n" in buf:
                raw, buf = buf.split(b"\n\n", 1)
                assert raw.startswith(b"data: ")
                events.append((time.monotonic(), raw[6:]))


async def test_health_refused_while_loading(tmp_path: Path) -> None:
    port = free_port()
    env = {**FAST, "LLMGW_SIM_LOAD_SECONDS": "1.5"}
    t0 = time.monotonic()
    with SimEngineProcess.start(vllm_args(port), env, log_dir=tmp_path) as eng:
        await trio.sleep(0.7)
        assert eng.proc.poll() is None
        assert eng.health() is None  # connection refused: not even listening
        await eng.wait_healthy_async()
        assert time.monotonic() - t0 >= 1.5
        assert eng.health() == 200
        assert "SIMULATED" in eng.log_text().splitlines()[0]


async def test_openai_endpoints(engine: SimEngineProcess) -> None:
    status, _, body = await request(engine.port, "GET", "/v1/models")
    models = json.loads(body)
    assert status == 200
    assert [(m["id"], m["owned_by"]) for m in models["data"]] == [("sim", "llmgw-simulated")]

    chat = {"model": "sim", "messages": [{"role": "user", "content": "hello there"}]}
    status, headers, body = await request(engine.port, "POST", "/v1/chat/completions", chat)
    assert status == 200 and headers["content-type"] == "application/json"
    resp = json.loads(body)
    assert resp["object"] == "chat.completion" and resp["model"] == "sim"
    assert resp["choices"][0]["message"]["role"] == "assistant"
    assert resp["choices"][0]["finish_reason"] == "stop"
    assert resp["usage"]["completion_tokens"] == 16
    assert resp["usage"]["total_tokens"] == resp["usage"]["prompt_tokens"] + 16

    comp = {"model": "sim", "prompt": "x", "max_tokens": 3}
    status, _, body = await request(engine.port, "POST", "/v1/completions", comp)
    resp = json.loads(body)
    assert resp["object"] == "text_completion"
    assert resp["choices"][0]["finish_reason"] == "length"
    assert len(resp["choices"][0]["text"].split()) == 3

    status, _, body = await request(engine.port, "POST", "/v1/embeddings", {"input": ["a", "b"]})
    vecs = [d["embedding"] for d in json.loads(body)["data"]]
    assert status == 200 and len(vecs) == 2 and vecs[0] != vecs[1]
    _, _, again = await request(engine.port, "POST", "/v1/embeddings", {"input": "a"})
    assert json.loads(again)["data"][0]["embedding"] == vecs[0]

    status, _, body = await request(engine.port, "POST", "/v1/chat/completions", b"{nope")
    assert status == 400 and json.loads(body)["error"]["code"] == 400
    status, _, body = await request(engine.port, "POST", "/v1/completions", {"model": "other"})
    assert status == 404 and "error" in json.loads(body)

    status, _, body = await request(engine.port, "GET", "/metrics")
    text = body.decode()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f'vllm:{name}{{engine="0",model_name="sim"}}' in text
    # As vLLM 0.32: split by reason too, and the parser must not count that twice.
    assert 'vllm:num_requests_waiting_by_reason{engine="0",model_name="sim",reason="capacity"}' in text


async def test_keep_alive(engine: SimEngineProcess) -> None:
    async with await trio.open_tcp_stream("127.0.0.1", engine.port) as stream:
        conn = h11.Connection(h11.CLIENT)
        for _ in range(3):
            await _send_request(stream, conn, "GET", "/health", None)
            assert (await _next(stream, conn)).status_code == 200
            assert isinstance(await _next(stream, conn), h11.EndOfMessage)
            conn.start_next_cycle()


async def test_stream_paced_by_token_rate(tmp_path: Path) -> None:
    env = {"LLMGW_SIM_TTFT": "0.3", "LLMGW_SIM_TOKENS_PER_SECOND": "20"}
    with SimEngineProcess.start(vllm_args(free_port()), env, log_dir=tmp_path) as eng:
        await eng.wait_healthy_async()
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 8}
        events = await stream_events(eng.port, "/v1/chat/completions", body)
    assert events[-1][1] == b"[DONE]"
    chunks = [json.loads(p) for _, p in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    # vLLM's shape: the last content delta carries the finish_reason (no empty delta after).
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"][0]["delta"].get("content")
    times = [t for (t, _), c in zip(events, chunks, strict=False) if c["choices"][0]["delta"].get("content")]
    assert len(times) == 8
    assert times[0] >= 0.25  # time to first token
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert 0.035 <= statistics.median(gaps) <= 0.08  # 20 tokens/s: 50 ms apart
    assert times[-1] - times[0] >= 7 * 0.045


async def test_client_disconnect_cancels_request(tmp_path: Path) -> None:
    env = {"LLMGW_SIM_TTFT": "0", "LLMGW_SIM_TOKENS_PER_SECOND": "50"}
    with SimEngineProcess.start(vllm_args(free_port()), env, log_dir=tmp_path) as eng:
        await eng.wait_healthy_async()
        body = {"prompt": "hi", "stream": True, "max_tokens": 1000}
        stream = await trio.open_tcp_stream("127.0.0.1", eng.port)
        conn = h11.Connection(h11.CLIENT)
        await _send_request(stream, conn, "POST", "/v1/completions", body)
        assert (await _next(stream, conn)).status_code == 200
        await _next(stream, conn)
        _, _, metrics = await request(eng.port, "GET", "/metrics")
        assert 'vllm:num_requests_running{engine="0",model_name="sim"} 1.0' in metrics.decode()
        await stream.aclose()
        await until(lambda: "cancelled by client" in eng.log_text(), 5)
        _, _, metrics = await request(eng.port, "GET", "/metrics")
        assert 'vllm:num_requests_running{engine="0",model_name="sim"} 0.0' in metrics.decode()
        assert "request cmpl-" in eng.log_text()


async def test_sigterm_crash_and_ignore(tmp_path: Path) -> None:
    with SimEngineProcess.start(vllm_args(free_port()), log_dir=tmp_path) as eng:
        await eng.wait_healthy_async()
        eng.proc.send_signal(signal.SIGTERM)
        assert eng.wait_exit(5) == 0
    env = {"LLMGW_SIM_IGNORE_SIGTERM": "1"}
    with SimEngineProcess.start(vllm_args(free_port()), env, log_dir=tmp_path) as eng:
        await eng.wait_healthy_async()
        eng.proc.send_signal(signal.SIGTERM)
        await trio.sleep(0.5)
        assert eng.proc.poll() is None and eng.health() == 200
        assert "ignored" in eng.log_text()
    with SimEngineProcess.start(
        vllm_args(free_port()), {"LLMGW_SIM_EXIT_AFTER": "0.5"}, log_dir=tmp_path
    ) as eng:
        assert eng.wait_exit(10) == 3


def _gang_args(rank: int, port: int, rdv: int) -> list[str]:
    args = vllm_args(port) + [
        "--nnodes", "2", "--node-rank", str(rank),
        "--master-addr", "127.0.0.1", "--master-port", str(rdv),
    ]  # fmt: skip
    return args + (["--headless"] if rank else [])


async def test_gang_ready_only_when_whole_and_member_exits_with_head(tmp_path: Path) -> None:
    port, rdv = free_port(), free_port()
    with SimEngineProcess.start(_gang_args(0, port, rdv), FAST, log_dir=tmp_path) as head:
        await trio.sleep(0.8)
        assert head.proc.poll() is None and head.health() is None  # waiting for rank 1
        with SimEngineProcess.start(_gang_args(1, port, rdv), FAST, log_dir=tmp_path) as member:
            await head.wait_healthy_async()
            assert member.proc.poll() is None
            head.stop()  # SIGKILL rank 0
            assert member.wait_exit(5) == 1
            assert "rank 0" in member.log_text()


async def test_gang_head_dies_with_member(tmp_path: Path) -> None:
    port, rdv = free_port(), free_port()
    # The member starts first: it retries until rank 0 listens.
    with SimEngineProcess.start(_gang_args(1, port, rdv), FAST, log_dir=tmp_path) as member:
        await trio.sleep(0.5)
        with SimEngineProcess.start(_gang_args(0, port, rdv), FAST, log_dir=tmp_path) as head:
            await head.wait_healthy_async()
            member.stop()
            await until(lambda: head.health() == 503, 3)
            assert head.wait_exit(5) == 1


async def test_sglang_shape_gang(tmp_path: Path) -> None:
    port, port1, rdv = free_port(), free_port(), free_port()

    def args(rank: int, p: int) -> list[str]:
        return [
            "--model-path", "org/m", "--served-model-name", "m", "--host", "127.0.0.1",
            "--port", str(p), "--tp-size", "1", "--nnodes", "2", "--node-rank", str(rank),
            "--dist-init-addr", f"127.0.0.1:{rdv}",
        ]  # fmt: skip

    with (
        SimEngineProcess.start(args(0, port), FAST, log_dir=tmp_path) as head,
        SimEngineProcess.start(args(1, port1), FAST, log_dir=tmp_path) as member,
    ):
        await head.wait_healthy_async()
        await member.wait_healthy_async()  # SGLang's other ranks: a dummy health server
        _, _, body = await request(port, "GET", "/v1/models")
        assert json.loads(body)["data"][0]["id"] == "m"


async def _raw(port: int, data: bytes) -> bytes:
    """Send raw bytes; everything the engine sends until it closes (or 5 s pass)."""
    out = b""
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(data)
        with trio.move_on_after(5):
            while chunk := await stream.receive_some(65536):
                out += chunk
    return out


async def test_http_framing_follows_llmgw_http1(engine: SimEngineProcess) -> None:
    """Requests are read by llmgw.http1's parser (the router's rules); answers framed by
    what the client can take."""
    bad = await _raw(engine.port, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                     b"transfer-encoding: gzip\r\n\r\n")
    head, _, body = bad.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"connection: close" in head
    assert json.loads(body)["error"]["code"] == 400
    # Two requests pipelined on one connection, the second asking to close: both answered.
    two = await _raw(engine.port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
                     b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert two.count(b"HTTP/1.1 200 ") == 2 and b'"object":"list"' in two
    # HEAD: the head only.
    head_only = await _raw(engine.port, b"HEAD /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert head_only.startswith(b"HTTP/1.1 ") and head_only.endswith(b"\r\n\r\n")
    # A stream to an HTTP/1.0 client: no chunked framing, its end is the connection's.
    body10 = json.dumps({"model": "sim", "prompt": "x", "max_tokens": 2, "stream": True}).encode()
    old = await _raw(engine.port, b"POST /v1/completions HTTP/1.0\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(body10), body10))
    head, _, rest = old.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower() and b"connection: close" in head
    assert rest.startswith(b"data: ") and rest.rstrip().endswith(b"data: [DONE]")

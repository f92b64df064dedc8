"""The router in-process (trio) in front of simulated engines running as real processes."""

from __future__ import annotations

import hashlib
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from fakes.engines import SimEngineProcess, free_port, vllm_args
from llmgw.config.router import RouterConfig, RouterKeysConfig
from llmgw.router.service import serve_router
from llmgw.simengine.api import token_text

MODEL = "sim"


def engine(tmp_path: Path, **env: str) -> SimEngineProcess:
    port = free_port()
    full = {"LLMGW_SIM_TTFT": "0.02", "LLMGW_SIM_TOKENS_PER_SECOND": "200"}
    full.update(env)
    return SimEngineProcess.start(vllm_args(port, MODEL), env=full, log_dir=tmp_path)


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[SimEngineProcess]]:
    engs = [engine(tmp_path), engine(tmp_path)]
    try:
        for e in engs:
            e.wait_healthy()
        yield engs
    finally:
        for e in engs:
            e.stop()


def table(engs: list[SimEngineProcess], version: int = 1) -> dict[str, Any]:
    return {
        "version": version,
        "models": {MODEL: [{"replica_id": f"r{i}", "url": e.url, "ready": True} for i, e in enumerate(engs)]},
    }


def config(**kw: Any) -> RouterConfig:
    base: dict[str, Any] = dict(
        server="tcp://127.0.0.1:1",
        keys=RouterKeysConfig(secret_key="", server_key=""),
        bind="127.0.0.1:0",
        metrics_interval=0.1,
        table_poll_interval=0.05,
    )
    base.update(kw)
    return RouterConfig(**base)


class Source:
    """A table source the test steers: a table, or failures."""

    def __init__(self, snap: dict[str, Any]) -> None:
        self.snap = snap
        self.fail = False
        self.calls = 0

    async def __call__(self, since: int) -> dict[str, Any]:
        self.calls += 1
        if self.fail:
            raise ConnectionError("server away")
        return self.snap


async def start_router(nursery: trio.Nursery, source: Source, **kw: Any) -> str:
    host, port = await nursery.start(
        lambda task_status: serve_router(config(**kw), table_source=source, task_status=task_status)
    )
    url = f"http://{host}:{port}"
    while source.calls == 0:  # noqa: ASYNC110
        await trio.sleep(0.01)
    return url


@pytest.fixture
async def router(engines: list[SimEngineProcess], nursery: trio.Nursery) -> AsyncIterator[str]:
    yield await start_router(nursery, Source(table(engines)))


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=10)


async def in_thread(fn: Any, *args: Any) -> Any:
    return await trio.to_thread.run_sync(fn, *args)


async def test_openai_client(router: str) -> None:
    c = client(router)

    def work() -> None:
        comp = c.completions.create(model=MODEL, prompt="hello", max_tokens=5)
        assert comp.choices[0].text
        chat = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        assert chat.choices[0].message.content
        parts = []
        for ev in c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        ):
            if ev.choices and ev.choices[0].delta.content:
                parts.append(ev.choices[0].delta.content)
        assert len(parts) >= 4
        assert [m.id for m in c.models.list()] == [MODEL]

    await in_thread(work)


def raw_stream(url: str, tokens: int, timeout: float = 10) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": tokens, "stream": True}).encode()
    s = socket.create_connection((host, int(port)), timeout=timeout)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return s


async def test_stream_events_arrive_spaced(router: str) -> None:
    def work() -> list[float]:
        s = raw_stream(router, 10)
        stamps: list[float] = []
        buf = b""
        with s:
            while b"[DONE]" not in buf:  # noqa: ASYNC110
                data = s.recv(65536)
                assert data
                buf += data
                if b"data: {" in data:
                    stamps.append(time.monotonic())
        return stamps

    stamps = await in_thread(work)
    # 200 tokens/s: events ~5 ms apart; one burst at the end would give one stamp.
    assert len(stamps) >= 6
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    assert sum(gaps) > 0.025


async def running(url: str) -> float:
    from llmgw.router.routing.loadwatch import parse_load

    def get() -> str:
        import urllib.request

        with urllib.request.urlopen(url + "/metrics", timeout=2) as r:
            return str(r.read().decode())

    load = parse_load(await in_thread(get))
    assert load is not None
    return load.running


async def test_client_disconnect_ends_engine_request(tmp_path: Path, nursery: trio.Nursery) -> None:
    with engine(tmp_path, LLMGW_SIM_TOKENS_PER_SECOND="5") as eng:
        await eng.wait_healthy_async()
        url = await start_router(nursery, Source(table([eng])))
        s = await in_thread(raw_stream, url, 200)
        with trio.fail_after(5):
            while await running(eng.url) < 1:  # noqa: ASYNC110
                await trio.sleep(0.05)
        s.close()
        with trio.fail_after(5):
            while await running(eng.url) > 0:  # noqa: ASYNC110
                await trio.sleep(0.05)


async def test_kill_replica_under_load(engines: list[SimEngineProcess], nursery: trio.Nursery) -> None:
    url = await start_router(nursery, Source(table(engines)))
    c = client(url)
    results: list[str] = []
    whole = "".join(token_text(i) for i in range(16))  # the simulated engine's whole answer

    def one(i: int) -> None:
        try:
            if i % 2:
                text = ""
                # Long enough (1 s at 200 tokens/s) to be in flight when the replica dies.
                for ev in c.completions.create(model=MODEL, prompt="p", max_tokens=200, stream=True):
                    text += ev.choices[0].text if ev.choices else ""
                results.append("stream-ok" if text == whole else f"stream-cut:{text!r}")
            else:
                c.completions.create(model=MODEL, prompt="p", max_tokens=40)
                results.append("ok")
        except openai.APIError as exc:
            results.append(f"error:{type(exc).__name__}:{exc}")

    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            for i in range(16):
                n.start_soon(in_thread, one, i)
            # Kill only once the doomed replica is busy, however slowly the threads start.
            while await running(engines[0].url) < 3:
                await trio.sleep(0.02)
            engines[0].stop()
    assert len(results) == 16
    # Non-streamed requests were retried on the survivor; streams in flight on the killed
    # replica went on on the survivor (mid-stream failover), each the whole answer.
    assert results.count("ok") == 8, results
    assert results.count("stream-ok") == 8, results
    after = await in_thread(lambda: c.completions.create(model=MODEL, prompt="p", max_tokens=2))
    assert after.choices


async def test_keeps_last_table_when_source_fails(
    engines: list[SimEngineProcess], nursery: trio.Nursery
) -> None:
    src = Source(table(engines))
    url = await start_router(nursery, src)
    src.fail = True
    calls = src.calls
    while src.calls < calls + 3:  # noqa: ASYNC110
        await trio.sleep(0.02)
    out = await in_thread(lambda: client(url).completions.create(model=MODEL, prompt="p", max_tokens=2))
    assert out.choices


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST")
    req.add_header("content-type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, None),
        (b'{"messages": []}', 400, None),
        (b'{"model": "nope", "messages": []}', 404, "model_not_found"),
        (b'{"model": "sim", "messages": [], "pad": "' + b"x" * 5000 + b'"}', 413, None),
    ],
)
async def test_bad_requests(
    engines: list[SimEngineProcess], nursery: trio.Nursery, body: bytes, status: int, code: Any
) -> None:
    url = await start_router(nursery, Source(table(engines)), max_body_bytes=4096)
    got, payload = await in_thread(post, url, body)
    assert got == status
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if code:
        assert err["code"] == code


async def test_api_keys(engines: list[SimEngineProcess], nursery: trio.Nursery, tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    digest = hashlib.sha256(b"sk-good").hexdigest()
    keys.write_text(f'[[key]]\nname = "t"\nsha256 = "{digest}"\nmodels = ["sim"]\n')
    url = await start_router(nursery, Source(table(engines)), api_keys_file=str(keys))
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}).encode()
    for headers in ({}, {"authorization": "Bearer sk-bad"}):
        got, payload = await in_thread(post, url, body, headers)
        assert got == 401
        assert payload["error"]["code"] == "invalid_api_key"
    got, payload = await in_thread(post, url, body, {"authorization": "Bearer sk-good"})
    assert got == 200, payload


def read_response(s: socket.socket, buf: bytes = b"") -> tuple[bytes, bytes, bytes]:
    """(head, body as framed on the wire, bytes after it) of one response on `s`."""
    while b"\r\n\r\n" not in buf:
        data = s.recv(65536)
        if not data:
            raise AssertionError(f"closed before a response head: {buf!r}")
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    low = head.lower()
    if b"content-length:" in low:
        n = int(low.split(b"content-length:")[1].split(b"\r\n")[0])
        while len(rest) < n:
            rest += s.recv(65536)
        return head, rest[:n], rest[n:]
    if b"transfer-encoding: chunked" in low:
        while b"\r\n0\r\n\r\n" not in rest and not rest.startswith(b"0\r\n\r\n"):
            data = s.recv(65536)
            assert data, "closed mid-body"
            rest += data
        end = rest.find(b"0\r\n\r\n") if rest.startswith(b"0\r\n") else rest.find(b"\r\n0\r\n\r\n") + 2
        return head, rest[: end + 5], rest[end + 5 :]
    while data := s.recv(65536):  # close-delimited
        rest += data
    return head, rest, b""


def raw(url: str, data: bytes, timeout: float = 10) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=timeout)
    s.sendall(data)
    return s


async def test_http_framing_edge_cases(router: str) -> None:
    """The lean request reader: chunked request bodies, Expect: 100-continue, pipelining,
    HTTP/1.0 (no chunked framing back), and malformed heads answered 400."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 3}).encode()
    sbody = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}).encode()

    def post_head(version: str, extra: str = "", length: int | None = None) -> bytes:
        cl = f"content-length: {length}\r\n" if length is not None else ""
        return f"POST /v1/completions HTTP/{version}\r\nhost: x\r\n{cl}{extra}\r\n".encode()

    def work() -> None:
        # A chunked request body, in two chunks.
        half = len(body) // 2
        chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (half, body[:half], len(body) - half, body[half:])
        with raw(router, post_head("1.1", "transfer-encoding: chunked\r\n") + chunked) as s:
            head, payload, _ = read_response(s)
            assert head.startswith(b"HTTP/1.1 200"), head
            assert json.loads(payload)["choices"]
        # Expect: 100-continue: the router says continue before the body is sent.
        with raw(router, post_head("1.1", "expect: 100-continue\r\n", len(body))) as s:
            assert s.recv(65536).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
            s.sendall(body)
            head, payload, _ = read_response(s)
            assert head.startswith(b"HTTP/1.1 200"), head
        # Two requests pipelined on one connection: two answers, in order.
        one = post_head("1.1", length=len(body)) + body
        with raw(router, one + one) as s:
            head, _, rest = read_response(s)
            assert head.startswith(b"HTTP/1.1 200"), head
            head, _, _ = read_response(s, rest)
            assert head.startswith(b"HTTP/1.1 200"), head
        # HTTP/1.0: a stream comes back close-delimited, events unframed.
        with raw(router, post_head("1.0", length=len(sbody)) + sbody) as s:
            head, payload, _ = read_response(s)
            assert head.startswith(b"HTTP/1.1 200"), head
            assert b"transfer-encoding" not in head.lower()
            assert payload.startswith(b"data: {") and b"data: [DONE]" in payload
        # Malformed heads: 400 with OpenAI's error shape, connection closed.
        for bad in (
            b"POST /v1/completions HTTP/1.1 extra\r\nhost: x\r\n\r\n",
            b"POST /v1/completions HTTP/1.1\r\nhost : x\r\n\r\n",
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n folded\r\n\r\n",
            b"POST /v1/completions HTTP/1.1\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
            b"POST /v1/completions HTTP/1.1\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n",
            b"POST /v1/completions HTTP/2.0\r\nhost: x\r\n\r\n",
        ):
            with raw(router, bad) as s:
                head, payload, _ = read_response(s)
                assert head.startswith(b"HTTP/1.1 400"), (bad, head)
                assert b"connection: close" in head.lower()
                assert set(json.loads(payload)["error"]) == {"message", "type", "param", "code"}

    await in_thread(work)


async def test_client_idle_timeout(engines: list[SimEngineProcess], nursery: trio.Nursery) -> None:
    """A client that sends nothing for idle_timeout is closed; a client that is silent while
    its (longer) stream is relayed is not, and neither is one that pauses between requests
    for less than the timeout."""
    url = await start_router(nursery, Source(table(engines)), idle_timeout=0.4)

    def work() -> None:
        with raw(url, b"") as s:  # nothing at all
            t0 = time.monotonic()
            assert s.recv(65536) == b""
            assert 0.3 < time.monotonic() - t0 < 3
        with raw(url, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n") as s:  # half a head
            assert s.recv(65536) == b""
        body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 160, "stream": True}).encode()
        one = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        with raw(url, one) as s:  # ~0.8 s of events at 200/s, client silent throughout
            head, payload, rest = read_response(s)
            assert head.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in payload, payload[-200:]
            for _ in range(2):
                time.sleep(0.25)
                s.sendall(one)
                head, payload, rest = read_response(s, rest)
                assert b"data: [DONE]" in payload

    await in_thread(work)


async def test_deployed_but_not_ready_is_503_with_the_reason_unknown_is_404(
    engines: list[SimEngineProcess], nursery: trio.Nursery
) -> None:
    why = "llama-70b: 0 of 2 replicas ready (1 pending: 0/3 nodes fit: 3 lacked 8 free GPUs, 1 starting)"
    snap = {**table(engines), "waiting": {"llama-70b": why}}
    url = await start_router(nursery, Source(snap))

    def ask(model: str) -> tuple[int, dict[str, Any], str | None]:
        import urllib.error
        import urllib.request

        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "x"}]}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, json.loads(r.read()), r.headers.get("retry-after")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), e.headers.get("retry-after")

    status, payload, retry = await in_thread(ask, "llama-70b")
    assert status == 503 and retry == "5"
    assert payload["error"]["code"] == "model_not_ready" and why in payload["error"]["message"]
    status, payload, retry = await in_thread(ask, "llama-7b")  # a typo
    assert status == 404 and retry is None and payload["error"]["code"] == "model_not_found"
    status, _, _ = await in_thread(ask, MODEL)
    assert status == 200


async def test_a_malformed_table_is_ignored_and_the_last_one_kept(
    engines: list[SimEngineProcess], nursery: trio.Nursery
) -> None:
    source = Source(table(engines))
    url = await start_router(nursery, source)
    for bad in ({"version": "x"}, {"version": 9, "models": {MODEL: [{"url": "nope"}]}},
                {"version": 9, "models": {MODEL: [{"replica_id": "r", "url": "http://h:99999"}]}},
                {"version": 9, "models": [[[]]]}):
        source.snap = bad  # type: ignore[assignment]
        await trio.sleep(0.2)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}).encode()
    status, _ = await in_thread(post, url, body)
    assert status == 200

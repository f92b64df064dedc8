"""Mid-stream failover through the router, in front of two simulated engines that crash
after sending a few tokens of a stream (LLMGW_SIM_DIE_AFTER_TOKENS): the client gets one
answer, the text one engine alone would have sent (the simulated engine's answer is a
function of its prompt, and goes on from a prompt that already holds its start)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import trio
from test_router import MODEL, Source, engine, start_router, table

from fakes.engines import SimEngineProcess
from llmgw.config.router import ModelRouteConfig
from llmgw.simengine.api import token_text


def expected(n: int) -> str:
    return "".join(token_text(i) for i in range(n))


async def dying_engines(tmp_path: Path, after: int) -> list[SimEngineProcess]:
    engs = [engine(tmp_path, LLMGW_SIM_DIE_AFTER_TOKENS=str(after)) for _ in range(2)]
    for e in engs:
        await e.wait_healthy_async()
    return engs


def post_stream(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    """The events of one streamed answer, read whole (urllib undoes the chunking)."""
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        raw = r.read()
    out: list[Any] = []
    for ev in raw.split(b"\n\n"):
        if ev.strip():
            assert ev.startswith(b"data: "), raw
            data = ev[6:]
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def text_of(events: list[Any], chat: bool) -> str:
    parts = []
    for e in events:
        if isinstance(e, dict):
            for c in e.get("choices", ()):
                parts.append((c["delta"].get("content") or "") if chat else c["text"])
    return "".join(parts)


def stop(engs: list[SimEngineProcess], dying: int) -> int:
    """How many engines died (waiting up to 5 s for `dying` of them: the client may read
    the end of its stream before the process is gone), then stop the others."""
    deadline = time.monotonic() + 5
    while sum(e.proc.poll() is not None for e in engs) < dying and time.monotonic() < deadline:
        time.sleep(0.02)
    dead = sum(e.proc.poll() is not None for e in engs)
    for e in engs:
        e.stop()
    return dead


async def test_completion_stream_goes_on_on_the_other_replica(tmp_path: Path, nursery: trio.Nursery) -> None:
    engs = await dying_engines(tmp_path, 5)
    try:
        url = await start_router(nursery, Source(table(engs)))
        body = {"model": MODEL, "prompt": "Say: ", "max_tokens": 8, "stream": True}
        events = await trio.to_thread.run_sync(post_stream, url, "/v1/completions", body)
    finally:
        dead = stop(engs, 1)
    assert dead == 1  # the first replica died after 5 tokens; the other sent the last 3
    assert text_of(events, chat=False) == expected(8)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    objs = [e for e in events if isinstance(e, dict)]
    assert not [e for e in objs if "error" in e]
    assert len({(e["id"], e["created"]) for e in objs}) == 1
    assert objs[-1]["choices"][0]["finish_reason"] == "length"


async def test_chat_stream_one_role_one_usage(tmp_path: Path, nursery: trio.Nursery) -> None:
    engs = await dying_engines(tmp_path, 5)
    try:
        url = await start_router(nursery, Source(table(engs)))
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                "stream": True, "stream_options": {"include_usage": True}}
        events = await trio.to_thread.run_sync(post_stream, url, "/v1/chat/completions", body)
        metrics = await trio.to_thread.run_sync(
            lambda: urllib.request.urlopen(url + "/metrics", timeout=5).read().decode())
    finally:
        dead = stop(engs, 1)
    assert dead == 1
    assert text_of(events, chat=True) == expected(8)
    objs = [e for e in events if isinstance(e, dict)]
    assert len({e["id"] for e in objs}) == 1
    assert sum("role" in c["delta"] for e in objs for c in e["choices"]) == 1
    # One usage: the original prompt (the simulated engine counts "hi" and its turn as 4),
    # the completion tokens of both replicas.
    assert [e["usage"] for e in objs if e.get("usage")] == [
        {"prompt_tokens": 4, "total_tokens": 12, "completion_tokens": 8}]
    assert 'llmgw_router_stream_failovers_total{model="sim",outcome="resumed"} 1.0' in metrics


async def test_migrations_are_bounded(tmp_path: Path, nursery: trio.Nursery) -> None:
    engs = await dying_engines(tmp_path, 3)
    try:
        url = await start_router(nursery, Source(table(engs)))
        body = {"model": MODEL, "prompt": "Say: ", "max_tokens": 10, "stream": True}
        events = await trio.to_thread.run_sync(post_stream, url, "/v1/completions", body)
    finally:
        dead = stop(engs, 2)
    # failover_migrations = 1 (the default): 3 tokens from each, then the error event.
    assert dead == 2
    assert text_of(events, chat=False) == expected(6)
    assert "error" in events[-1] and "[DONE]" not in events


async def test_failover_off_ends_the_stream_as_before(tmp_path: Path, nursery: trio.Nursery) -> None:
    engs = await dying_engines(tmp_path, 5)
    try:
        url = await start_router(nursery, Source(table(engs)),
                                 models={MODEL: ModelRouteConfig(failover_migrations=0)})
        body = {"model": MODEL, "prompt": "Say: ", "max_tokens": 8, "stream": True}
        events = await trio.to_thread.run_sync(post_stream, url, "/v1/completions", body)
    finally:
        dead = stop(engs, 1)
    assert dead == 1
    assert text_of(events, chat=False) == expected(5)
    assert "error" in events[-1]

"""The router in front of simulated engines that require their own keys (issue 30 item 2),
each under llmgw's guard as the agent starts them: the router sends each engine the key
the table gives for it, never the client's Authorization; an engine that refuses the key
(restarted with a new one the router has not polled yet) is the engine's failure: the
request goes to another replica, and with none left the client gets 502, not a 401 that
would blame its own key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from test_router import MODEL, Source, post, start_router

from fakes.engines import SimEngineProcess, free_port, vllm_args

GUARD = ["--middleware", "llmgw_engine_guard.EngineKeyGuard"]
BODY = b'{"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[list[tuple[SimEngineProcess, str]]]:
    engs = []
    try:
        for i in range(2):
            key = f"llmgw-engine-{i}"
            e = SimEngineProcess.start([*vllm_args(free_port(), MODEL), *GUARD],
                                       env={"VLLM_API_KEY": key, "LLMGW_SIM_TTFT": "0.01"},
                                       log_dir=tmp_path)
            engs.append((e, key))
        for e, _ in engs:
            e.wait_healthy()
        yield engs
    finally:
        for e, _ in engs:
            e.stop()


def table(rows: list[tuple[SimEngineProcess, str]], version: int = 1) -> dict[str, Any]:
    return {"version": version, "models": {MODEL: [
        {"replica_id": f"r{i}", "url": e.url, "ready": True, "key": key}
        for i, (e, key) in enumerate(rows)]}}


async def _post(url: str) -> tuple[int, Any]:
    return await trio.to_thread.run_sync(
        lambda: post(url, BODY, {"Authorization": "Bearer client-own-key"}))


async def test_the_router_sends_each_engine_its_own_key(
        keyed: list[tuple[SimEngineProcess, str]], nursery: trio.Nursery) -> None:
    (a, _), (b, _) = keyed
    assert (await trio.to_thread.run_sync(post, a.url, BODY))[0] == 401  # no key: refused
    url = await start_router(nursery, Source(table(keyed)))
    for _ in range(6):  # both replicas, each with its own key (a client key would be refused)
        status, doc = await _post(url)
        assert status == 200, doc


async def test_an_engine_that_refuses_its_key_is_a_failed_replica_not_a_401(
        keyed: list[tuple[SimEngineProcess, str]], nursery: trio.Nursery) -> None:
    (a, _), (b, key_b) = keyed
    stale = [(a, "llmgw-stale"), (b, key_b)]
    source = Source(table(stale))
    url = await start_router(nursery, source)
    for _ in range(6):  # r0 refuses the stale key: every request is served by r1
        status, doc = await _post(url)
        assert status == 200, doc
    source.snap = table([(a, "llmgw-stale")], version=2)
    await trio.sleep(0.3)  # the router polls every 50 ms
    status, doc = await _post(url)
    assert status == 502, doc
    assert "refused the key" in doc["error"]["message"], doc

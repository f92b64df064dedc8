"""vLLM's sleep mode on the simulated engine, as a real process (issue 25): the endpoints
only with VLLM_SERVER_DEV_MODE, vLLM's bodies and refusals; a request sent while it sleeps
waits (vLLM's paused scheduler queues it) and is answered once woken; the process is the
same one; the wake (agent/lifecycle/sleep.py) measured."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from fakes.engines import SimEngineProcess, free_port, vllm_args
from llmgw.agent.lifecycle import sleep as engine_sleep
from llmgw.agent.lora.sync import call

FAST = {"LLMGW_SIM_TTFT": "0.01", "LLMGW_SIM_TOKENS_PER_SECOND": "1000"}


def _start(tmp_path: Path, flags: list[str], env: dict[str, str]) -> SimEngineProcess:
    eng = SimEngineProcess.start([*vllm_args(free_port()), *flags], {**FAST, **env}, log_dir=tmp_path)
    eng.wait_healthy()
    return eng


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[SimEngineProcess]:
    with _start(tmp_path, ["--enable-sleep-mode"], {"VLLM_SERVER_DEV_MODE": "1"}) as eng:
        yield eng


async def _complete(eng: SimEngineProcess) -> tuple[int, dict]:
    status, body = await call(eng.host, eng.port, "POST", "/v1/completions",
                              {"model": "sim", "prompt": "hi", "max_tokens": 2}, timeout=10)
    return status, json.loads(body)


async def test_a_request_to_a_sleeping_engine_waits_and_is_answered_once_woken(
        engine: SimEngineProcess) -> None:
    pid = engine.pid
    assert await engine_sleep.is_sleeping(engine.host, engine.port) is False
    status, body = await call(engine.host, engine.port, "POST", "/sleep?level=1", timeout=5)
    assert (status, json.loads(body)) == (200, {"status": "sleeping", "level": 1})
    assert await engine_sleep.is_sleeping(engine.host, engine.port) is True
    answers: list[tuple[int, dict]] = []

    async def ask() -> None:
        answers.append(await _complete(engine))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        await trio.sleep(0.5)
        assert answers == []  # queued, not refused, while asleep
        took = await engine_sleep.wake(engine.host, engine.port, timeout=5)
    assert took < 1.0, took
    (status, answer), = answers
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
    assert engine.pid == pid and engine.proc.poll() is None  # the same process, awake
    assert await engine_sleep.is_sleeping(engine.host, engine.port) is False
    # Both calls are idempotent, as vLLM's are: asleep twice, woken twice.
    await engine_sleep.sleep(engine.host, engine.port)
    await engine_sleep.sleep(engine.host, engine.port)
    await engine_sleep.wake(engine.host, engine.port)
    status, body = await call(engine.host, engine.port, "POST", "/wake_up", timeout=5)
    assert (status, json.loads(body)) == (200, {"status": "awake", "tags": None})
    assert (await _complete(engine))[0] == 200


async def test_vllms_refusals(engine: SimEngineProcess, tmp_path: Path) -> None:
    status, body = await call(engine.host, engine.port, "POST", "/sleep?level=3", timeout=5)
    assert status == 400 and json.loads(body)["error"]["type"] == "BadRequestError"
    status, body = await call(engine.host, engine.port, "POST", "/sleep?level=1&mode=drain", timeout=5)
    assert status == 400 and "mode" in json.loads(body)["error"]["message"]
    status, _ = await call(engine.host, engine.port, "GET", "/sleep", timeout=5)
    assert status == 405
    # Without VLLM_SERVER_DEV_MODE vLLM mounts none of them.
    with _start(tmp_path, ["--enable-sleep-mode"], {}) as plain:
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
            assert (await call(plain.host, plain.port, method, path, timeout=5))[0] == 404
    # With the endpoints but no --enable-sleep-mode, level 1 has nothing it may free.
    with _start(tmp_path, [], {"VLLM_SERVER_DEV_MODE": "1"}) as nosleep:
        status, body = await call(nosleep.host, nosleep.port, "POST", "/sleep?level=1", timeout=5)
        assert status == 500 and "Sleep mode is not enabled" in json.loads(body)["error"]["message"]

"""LoRA adapters on the simulated engine, as a real process: vLLM's load and unload
endpoints, statuses and messages, /v1/models cards, answers in an adapter's name; and the
agent's sync (adapter_sync) converging a running engine on a wanted list."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from fakes.adapters import write_adapter
from fakes.engines import SimEngineProcess, free_port, vllm_args
from llmgw.agent.lora.adapters import SyncResult
from llmgw.agent.lora.sync import AdapterKeeper, call, sync_adapters
from llmgw.model.engine import Adapter

FAST = {"LLMGW_SIM_TTFT": "0.01", "LLMGW_SIM_TOKENS_PER_SECOND": "1000"}
LORA = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[SimEngineProcess]:
    env = {**FAST, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with SimEngineProcess.start([*vllm_args(free_port()), *LORA], env, log_dir=tmp_path) as eng:
        eng.wait_healthy()
        yield eng


async def _models(eng: SimEngineProcess) -> dict[str, dict]:
    status, body = await call(eng.host, eng.port, "GET", "/v1/models", timeout=5)
    assert status == 200
    return {c["id"]: c for c in json.loads(body)["data"]}


async def _complete(eng: SimEngineProcess, model: str) -> tuple[int, dict]:
    status, body = await call(eng.host, eng.port, "POST", "/v1/completions",
                              {"model": model, "prompt": "hi", "max_tokens": 2}, timeout=5)
    return status, json.loads(body)


async def test_the_sync_loads_and_unloads_on_a_running_engine(engine: SimEngineProcess,
                                                              tmp_path: Path) -> None:
    sql = write_adapter(tmp_path / "sql")
    chat = write_adapter(tmp_path / "chat")
    wanted = (Adapter("sim-sql", str(sql)), Adapter("sim-chat", str(chat)))
    result = await sync_adapters(engine.host, engine.port, "sim", wanted)
    assert result.loaded == ("sim-sql", "sim-chat") and result.errors == ()
    cards = await _models(engine)
    assert cards["sim-sql"]["parent"] == "sim" and cards["sim-sql"]["root"] == str(sql)
    assert cards["sim"]["parent"] is None
    status, answer = await _complete(engine, "sim-sql")
    assert status == 200 and answer["model"] == "sim-sql"
    # Again with the same list: nothing to do, nothing changes.
    assert await sync_adapters(engine.host, engine.port, "sim", wanted) == result
    # One removed: unloaded, and then unknown to the engine, as a model would be.
    result = await sync_adapters(engine.host, engine.port, "sim", wanted[1:])
    assert result.loaded == ("sim-chat",)
    status, answer = await _complete(engine, "sim-sql")
    assert status == 404 and answer["error"]["type"] == "NotFoundError"


async def test_a_bad_adapter_is_its_own_error_and_the_others_load(engine: SimEngineProcess,
                                                                  tmp_path: Path) -> None:
    good = write_adapter(tmp_path / "good")
    big = write_adapter(tmp_path / "big", rank=64)
    wanted = (Adapter("ok", str(good)), Adapter("nowhere", "/no/such/adapter"), Adapter("big", str(big)))
    result = await sync_adapters(engine.host, engine.port, "sim", wanted)
    assert result.loaded == ("ok",)
    errors = dict(e.split(": ", 1) for e in result.errors)
    assert errors["nowhere"] == ("Loading lora nowhere failed: No adapter found for "
                                 "/no/such/adapter (HTTP 404)")
    assert "LoRA rank 64 is greater than max_lora_rank 16" in errors["big"]
    assert (await _complete(engine, "sim"))[0] == 200  # the base serves on


async def test_vllms_own_refusals(engine: SimEngineProcess, tmp_path: Path) -> None:
    path = str(write_adapter(tmp_path / "a"))

    async def post(where: str, body: dict) -> tuple[int, str]:
        status, raw = await call(engine.host, engine.port, "POST", where, body, timeout=5)
        return status, raw.decode()

    assert await post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": path}) == (
        200, "Success: LoRA adapter 'a' added successfully.")
    status, text = await post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": path})
    assert status == 400 and "has already been loaded" in text
    status, text = await post("/v1/load_lora_adapter", {"lora_name": "sim", "lora_path": path})
    assert status == 400 and "conflicts with a served base model" in text
    status, text = await post("/v1/load_lora_adapter", {"lora_name": "b"})
    assert status == 400 and "Both 'lora_name' and 'lora_path' must be provided." in text
    status, text = await post("/v1/unload_lora_adapter", {"lora_name": "zzz"})
    assert status == 404 and "The lora adapter 'zzz' cannot be found." in text


async def test_without_runtime_updating_the_endpoints_do_not_exist(tmp_path: Path) -> None:
    with SimEngineProcess.start([*vllm_args(free_port()), *LORA], FAST, log_dir=tmp_path) as eng:
        await eng.wait_healthy_async()
        status, _ = await call(eng.host, eng.port, "POST", "/v1/load_lora_adapter",
                               {"lora_name": "a", "lora_path": "/x"}, timeout=5)
        assert status == 404


async def test_an_engine_that_cannot_be_asked_keeps_what_it_had(tmp_path: Path) -> None:
    env = {**FAST, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    sql = Adapter("sim-sql", str(write_adapter(tmp_path / "sql")))
    results: list[SyncResult] = []
    with SimEngineProcess.start([*vllm_args(free_port()), *LORA], env, log_dir=tmp_path) as eng:
        await eng.wait_healthy_async()
        keeper = AdapterKeeper(eng.host, eng.port, "r", lambda: ("sim", (sql,)), lambda: True,
                               results.append)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keeper.run)
            keeper.poke()
            with trio.fail_after(10):
                while not results:
                    await trio.sleep(0.02)
            assert results[-1] == SyncResult(("sim-sql",), ())
            eng.stop()  # gone (or too busy to answer): nothing new is learnt
            keeper.poke()
            with trio.fail_after(10):
                while len(results) < 2:
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()
    assert results[-1].loaded == ("sim-sql",)
    assert results[-1].errors[0].startswith("cannot ask the engine: GET /v1/models")

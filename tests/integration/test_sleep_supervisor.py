"""The supervisor sleeps and wakes a running engine as its spec's `asleep` says, with no
restart (the pid stays): one started while its deployment sleeps goes to sleep once ready,
and an agent that adopts a sleeping engine wakes it when the server's set says so."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import trio
from attrs import evolve

from fakes.engine_keys import engine_key
from fakes.engines import free_port
from fakes.supervision import Reports
from fakes.supervisor_proc import config
from llmgw.agent.lifecycle import sleep as engine_sleep
from llmgw.agent.lifecycle.records import read_records
from llmgw.agent.lifecycle.supervisor import Supervisor
from llmgw.agent.lora.sync import call
from llmgw.model.engine import EngineKind, EngineReport, EngineSpec, EngineState

FAST = {"LLMGW_SIM_TTFT": "0.01", "LLMGW_SIM_TOKENS_PER_SECOND": "1000"}


async def _ready(reports: Reports, rid: str) -> EngineReport:
    with trio.fail_after(15):
        while (r := reports.last(rid)) is None or r.state is not EngineState.READY:
            await trio.sleep(0.05)
        return r


async def _until(spec: EngineSpec, asleep: bool) -> None:
    with trio.fail_after(10):
        while await engine_sleep.is_sleeping("127.0.0.1", spec.port,
                                             key=engine_key(spec.port)) is not asleep:
            await trio.sleep(0.02)


async def test_asleep_follows_the_spec_without_a_restart(tmp_path: Path) -> None:
    rid = f"s{uuid.uuid4().hex[:8]}-0"
    # Its deployment sleeps already: the engine starts (awake, as vLLM does) and sleeps.
    spec = EngineSpec(rid, 1, "dep", "org/sim", "m", EngineKind.SIMULATED, (), free_port(),
                      env=FAST, startup_timeout=30, sleep_mode=True, asleep=True)
    reports = Reports()
    work = str(tmp_path / "work")
    sup = Supervisor(config(work), reports)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        await sup.apply((spec,))
        first = await _ready(reports, rid)
        await _until(spec, True)
        await sup.apply((evolve(spec, asleep=False),))
        await _until(spec, False)
        status, body = await call("127.0.0.1", spec.port, "POST", "/v1/completions",
                                  {"model": "m", "prompt": "hi", "max_tokens": 2}, timeout=5,
                                  key=engine_key(spec.port))
        assert status == 200 and json.loads(body)["choices"]
        await sup.apply((spec,))
        await _until(spec, True)
        (record,) = read_records(work)
        assert record.spec.asleep and record.pid == first.pid
        assert all(r.pid == first.pid and r.state is not EngineState.EXITED for r in reports.seen
                   if r.pid)
        nursery.cancel_scope.cancel()  # the agent goes away; the engine stays, asleep

    again = Reports()
    sup2 = Supervisor(config(work), again)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup2.serve)
        assert (await _ready(again, rid)).pid == first.pid
        await sup2.apply((evolve(spec, asleep=False),))
        await _until(spec, False)
        await sup2.apply(())
        nursery.cancel_scope.cancel()

"""The supervisor keeps a running engine's LoRA adapters in step with its spec: loaded
once it is ready, loaded and unloaded as the list changes, with no restart (the pid stays),
and found again by an agent that adopts the engine."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from attrs import evolve

from fakes.adapters import write_adapter
from fakes.engines import free_port
from fakes.supervision import Reports
from fakes.supervisor_proc import config
from llmgw.agent.lifecycle.records import read_records
from llmgw.agent.lifecycle.supervisor import Supervisor
from llmgw.model.engine import Adapter, EngineKind, EngineReport, EngineSpec, EngineState

FAST = {"LLMGW_SIM_TTFT": "0.01", "LLMGW_SIM_TOKENS_PER_SECOND": "1000"}


@pytest.fixture
def rid() -> Iterator[str]:
    yield f"a{uuid.uuid4().hex[:8]}-0"


async def _adapters(reports: Reports, rid: str, want: tuple[str, ...], timeout: float = 15) -> EngineReport:
    with trio.fail_after(timeout):
        while True:
            r = reports.last(rid)
            if r is not None and r.state is EngineState.READY and r.adapters == want:
                return r
            await trio.sleep(0.05)


async def test_adapters_follow_the_spec_without_a_restart(tmp_path: Path, rid: str) -> None:
    sql = Adapter("m-sql", str(write_adapter(tmp_path / "sql")))
    chat = Adapter("m-chat", str(write_adapter(tmp_path / "chat")))
    spec = EngineSpec(rid, 1, "dep", "org/sim", "m", EngineKind.SIMULATED, (), free_port(),
                      env=FAST, startup_timeout=30, adapters=(sql,), max_loras=2)
    reports = Reports()
    work = str(tmp_path / "work")
    sup = Supervisor(config(work), reports)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        await sup.apply((spec,))
        first = await _adapters(reports, rid, ("m-sql",))
        # Added: loaded on the running engine.
        await sup.apply((evolve(spec, adapters=(sql, chat)),))
        assert (await _adapters(reports, rid, ("m-sql", "m-chat"))).pid == first.pid
        # Removed: unloaded; the record on disk holds the list an adopting agent needs.
        await sup.apply((evolve(spec, adapters=(chat,)),))
        assert (await _adapters(reports, rid, ("m-chat",))).pid == first.pid
        (record,) = read_records(work)
        assert record.spec.adapters == (chat,)
        # A path no node sees: reported, the others stay loaded, the engine serves on.
        lost = Adapter("m-lost", "/no/such/adapter")
        await sup.apply((evolve(spec, adapters=(chat, lost)),))
        with trio.fail_after(15):
            while not (reports.last(rid) or first).adapter_errors:
                await trio.sleep(0.05)
        last = reports.last(rid)
        assert last is not None and last.adapters == ("m-chat",) and last.pid == first.pid
        assert last.adapter_errors == ("m-lost: Loading lora m-lost failed: No adapter found for "
                                       "/no/such/adapter (HTTP 404)",)
        assert all(r.state is not EngineState.EXITED for r in reports.seen)
        nursery.cancel_scope.cancel()  # the agent goes away; the engine stays

    again = Reports()
    sup2 = Supervisor(config(work), again)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup2.serve)
        adopted = await _adapters(again, rid, ("m-chat",))
        assert adopted.pid == first.pid
        await sup2.apply(())
        nursery.cancel_scope.cancel()

"""In-place changes to a running engine: a spec that changed only in its LoRA adapters,
or only in whether it sleeps (autoscale.sleep_when_idle), keeps its process, generation
and all: its record takes the new spec, and the engine is told (lora/sync.py, sleep.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import trio
from attrs import evolve

from llmgw.agent.lifecycle import sleep as engine_sleep
from llmgw.agent.lifecycle.engine import Engine
from llmgw.agent.lifecycle.records import write_record
from llmgw.agent.lifecycle.states import Phase
from llmgw.agent.lora.adapters import SyncResult
from llmgw.agent.lora.sync import AdapterKeeper
from llmgw.model.engine import RUNTIME_ADAPTERS, Adapter, EngineSpec

log = logging.getLogger(__name__)


def new_adapters(engines: Mapping[str, Engine], desired: tuple[EngineSpec, ...],
                 work_dir: str) -> None:
    """A running engine whose spec changed only in its adapters (the server updates a
    replica in place for that, generation and all) keeps running: its record takes the
    new spec, and its keeper loads and unloads the difference."""
    for spec in desired:
        eng = engines.get(spec.replica_id)
        if eng is None or eng.spec.generation != spec.generation or eng.spec.adapters == spec.adapters:
            continue
        eng.record = evolve(eng.record, spec=evolve(eng.spec, adapters=spec.adapters,
                                                    origin=spec.origin))
        try:
            write_record(work_dir, eng.record)
        except OSError as exc:  # the engine runs on; an adopting agent syncs again anyway
            log.warning("engine %s: cannot write its record: %s", spec.replica_id, exc)
        log.info("engine %s gen %d: adapters now %s", spec.replica_id, spec.generation,
                 ", ".join(a.name for a in spec.adapters) or "none")
        if eng.adapters is not None:
            eng.adapters.poke()


def new_sleep(engines: Mapping[str, Engine], desired: tuple[EngineSpec, ...], work_dir: str,
              follow: Callable[[Engine], None]) -> None:
    """autoscale.sleep_when_idle: a running engine whose spec changed only in `asleep`
    is put to sleep or woken in place (sleep.py), by its API server's head."""
    for spec in desired:
        eng = engines.get(spec.replica_id)
        if eng is None or eng.spec.generation != spec.generation or eng.spec.asleep == spec.asleep:
            continue
        eng.record = evolve(eng.record, spec=evolve(eng.spec, asleep=spec.asleep))
        try:
            write_record(work_dir, eng.record)
        except OSError as exc:  # it sleeps or wakes anyway; the server's next set says again
            log.warning("engine %s: cannot write its record: %s", spec.replica_id, exc)
        follow(eng)


def follow_sleep(nursery: trio.Nursery, engines: Mapping[str, Engine], eng: Engine,
                 host: str) -> None:
    """Put `eng` to sleep or wake it, for as long as it is the engine of its replica."""
    if not eng.health:  # a headless member: its head's API server sleeps the gang
        return
    rid = eng.spec.replica_id

    def wanted() -> bool | None:
        return eng.spec.asleep if engines.get(rid) is eng else None

    nursery.start_soon(engine_sleep.follow, host, eng.spec.port, rid, wanted,
                       eng.record.api_key)


def keeper(eng: Engine, host: str, on_report: Callable[[Engine], None]) -> AdapterKeeper | None:
    """The keeper of `eng`'s LoRA adapters; None for an engine that cannot load them."""
    spec = eng.spec
    if not eng.health or not spec.max_loras or spec.engine not in RUNTIME_ADAPTERS:
        return None

    def wanted() -> tuple[str, tuple[Adapter, ...]]:
        return eng.spec.served_name or eng.spec.model, eng.spec.adapters

    def on_result(result: SyncResult) -> None:
        if (result.loaded, result.errors) == (eng.report.adapters, eng.report.adapter_errors):
            return
        eng.report = evolve(eng.report, adapters=result.loaded, adapter_errors=result.errors)
        on_report(eng)

    return AdapterKeeper(host, spec.port, spec.replica_id, wanted,
                         lambda: eng.state is Phase.READY, on_result, eng.record.api_key)

"""The supervisor starts an engine on the copy the node's scan found and says which (issue
23): in the engine's report, its record, the agent's log and the engine's own log; an
adopted engine reports it again from its record. The simulated engine stands in for vLLM
(it takes vLLM's command line and serves the deployment's name whatever it is given)."""

from __future__ import annotations

import logging
from pathlib import Path

import attrs
import pytest
import trio

from fakes.engines import free_port
from fakes.supervision import Reports, chat
from fakes.supervisor_proc import config
from llmgw.agent.lifecycle.records import LOG, engine_dir, read_records
from llmgw.agent.lifecycle.supervisor import Supervisor
from llmgw.config.agent import ModelDirConfig
from llmgw.model.engine import EngineKind, EngineSpec, EngineState
from llmgw.model.inventory import ModelCopy, StorageReport

COPY = ModelCopy("org/tiny", "/data/models/org/tiny", 9, True)
LINE = "org/tiny: local plain tree /data/models/org/tiny"


async def test_report_record_and_logs_name_the_copy(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.agent.lifecycle")
    work = str(tmp_path)
    cfg = attrs.evolve(config(work), model_dirs=(ModelDirConfig("/data/models"),))
    spec = EngineSpec("r1", 1, "tiny", "org/tiny", "tiny", EngineKind.SIMULATED, (), free_port())
    storage = StorageReport(True, (COPY,))
    reports = Reports()
    sup = Supervisor(cfg, reports, storage=lambda: storage)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        await sup.apply((spec,))
        ready = await reports.wait("r1", EngineState.READY)
        assert ready.weights == LINE
        assert [r.weights for r in read_records(work)] == [LINE]
        # Served by the deployment's name, though started on a path.
        assert await trio.to_thread.run_sync(chat, spec.port, "tiny") == 200
        nursery.cancel_scope.cancel()  # the agent stops; the engine runs on
    assert f"engine r1 gen 1: weights {LINE}" in caplog.text
    assert f"llmgw agent: weights {LINE}" in (Path(engine_dir(work, "r1")) / LOG).read_text()

    adopted = Reports()
    again = Supervisor(cfg, adopted, storage=lambda: StorageReport(True, ()))
    async with trio.open_nursery() as nursery:
        await nursery.start(again.serve)
        report = await adopted.wait("r1", EngineState.READY)
        assert report.weights == LINE  # what it was started on, not today's scan
        await again.apply(())
        gone = await adopted.wait("r1", EngineState.EXITED)
        assert gone.weights == LINE
        nursery.cancel_scope.cancel()


async def test_without_storage_nothing_is_said(tmp_path: Path) -> None:
    work = str(tmp_path)
    spec = EngineSpec("r2", 1, "tiny", "org/tiny", "tiny", EngineKind.SIMULATED, (), free_port())
    reports = Reports()
    sup = Supervisor(config(work), reports)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        await sup.apply((spec,))
        assert (await reports.wait("r2", EngineState.READY)).weights == ""
        await sup.apply(())
        await reports.wait("r2", EngineState.EXITED)
        nursery.cancel_scope.cancel()

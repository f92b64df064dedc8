"""Engine records keep the CUDA indices an engine was given (issue 18); records written
before that field still load, and an adopted engine's plan is asked with its indices."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import trio
from cattrs.preconf.json import make_converter

from fakes.supervision import PlanLog, Reports
from fakes.supervisor_proc import config
from llmgw.agent.lifecycle.records import RECORD, EngineRecord, engine_dir, read_records, write_record
from llmgw.agent.lifecycle.supervisor import Supervisor
from llmgw.agent.process import procs
from llmgw.model.engine import EngineKind, EngineSpec, EngineState

SPEC = EngineSpec("r1", 1, "dep", "org/m", "m", EngineKind.VLLM, ("GPU-a", "GPU-b"), 20000)


def test_indices_round_trip_and_old_records_load(tmp_path: Path) -> None:
    rec = EngineRecord(SPEC, "/x/engine.log", cuda_devices=(3, 0)).completed(10, 10, 5)
    write_record(str(tmp_path), rec)
    assert read_records(str(tmp_path)) == [rec]
    old = make_converter().unstructure(rec)
    del old["cuda_devices"]  # as an agent before issue 18 wrote it
    path = os.path.join(engine_dir(str(tmp_path), "r1"), RECORD)
    Path(path).write_text(json.dumps(old))
    (loaded,) = read_records(str(tmp_path))
    assert loaded.cuda_devices == () and loaded.pid == 10


async def test_adopted_engine_plan_gets_its_recorded_indices(tmp_path: Path) -> None:
    log_path = str(tmp_path / "engine.log")
    pid = procs.spawn(["sleep", "60"], env={**os.environ, procs.REPLICA_ENV: "r1:1"}, cwd=None,
                      log_path=log_path)
    try:
        started = procs.start_time(pid)
        assert started is not None
        write_record(str(tmp_path), EngineRecord(SPEC, log_path, cuda_devices=(3, 0))
                     .completed(pid, pid, started))
        plan = PlanLog()
        reports = Reports()
        sup = Supervisor(config(str(tmp_path)), reports, plan=plan)
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.serve)
            assert plan.calls == [(SPEC, {"GPU-a": 3, "GPU-b": 0})]
            await reports.wait("r1", EngineState.READY)  # liveness only, as planned
            assert pid in sup.engine_pids()
            nursery.cancel_scope.cancel()
    finally:
        os.kill(pid, signal.SIGKILL)
        for _ in range(100):
            if procs.try_reap(pid) is not None:
                break
            await trio.sleep(0.01)

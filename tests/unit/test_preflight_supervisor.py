"""The agent reports its engine's pre-flight (issue 22): "running" from the spawn of a
gang member whose plan carries a probe, then the launcher's result (preflight.json) with
the bus bandwidth, in the engine's report, so the server can hold the replica in
PREFLIGHT; a failed probe's line comes with the exit. A probe double (engines.
preflight_probe) stands in for torch; the simulated engine for vLLM."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import attrs
import trio

from fakes.engines import free_port
from fakes.supervision import Reports
from fakes.supervisor_proc import config
from llmgw.agent.lifecycle.supervisor import Supervisor
from llmgw.config.agent import EnginesConfig
from llmgw.model.engine import EngineKind, EngineReport, EngineSpec, EngineState, GangSpec
from llmgw.model.preflight import EXIT_CODE

PROBE = """import json, time
time.sleep(1.0)  # long enough for the agent to report it running
print("LLMGW_PREFLIGHT " + json.dumps({"ok": True, "backend": "gloo", "world": 2, "seconds": 1.0,
      "results": [{"bytes": 65536, "seconds": 0.01, "algbw_gbps": 0.1, "busbw_gbps": 0.1},
                  {"bytes": 4194304, "seconds": 0.01, "algbw_gbps": BW, "busbw_gbps": BW}]}))
"""


def _setup(tmp_path: Path, bw: float, floor: float) -> tuple[Supervisor, Reports, EngineSpec]:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE.replace("BW", repr(bw)))
    cfg = attrs.evolve(config(str(tmp_path / "work")),
                       engines=EnginesConfig(preflight_python=sys.executable,
                                             preflight_probe=str(probe)))
    gang = GangSpec(2, 1, "127.0.0.1", free_port(), preflight="required", preflight_timeout=10.0,
                    preflight_min_busbw=floor)
    spec = EngineSpec("g-0", 1, "g", "org/g", "g", EngineKind.SIMULATED, (), free_port(), gang=gang)
    reports = Reports()
    return Supervisor(cfg, reports), reports, spec


async def _first(reports: Reports, want: str) -> EngineReport:
    with trio.fail_after(20):
        while True:
            for r in reports.seen:
                if r.preflight.startswith(want):
                    return r
            await trio.sleep(0.05)


async def test_running_then_passed_with_its_figures(tmp_path: Path) -> None:
    sup, reports, spec = _setup(tmp_path, 1.15, 0.5)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        await sup.apply((spec,))
        running = await _first(reports, "running")
        assert running.state == EngineState.STARTING and running.preflight_busbw_gbps == 0.0
        passed = await _first(reports, "passed")
        assert passed.preflight == "passed: gloo x2, 4 MiB at 1.15 GB/s bus bandwidth, in 1.0s"
        assert passed.preflight_busbw_gbps == 1.15
        await reports.wait("g-0", EngineState.READY)
        assert sup.reports()[0].preflight == passed.preflight  # kept in later reports
        await sup.apply(())
        await reports.wait("g-0", EngineState.EXITED)
        nursery.cancel_scope.cancel()


async def test_a_failed_probe_is_reported_with_the_exit(tmp_path: Path) -> None:
    sup, reports, spec = _setup(tmp_path, 0.4, 10.0)
    work = tmp_path / "work" / "engines" / "g-0"
    work.mkdir(parents=True)
    # An earlier start's result is not this one's: removed before the spawn.
    (work / "preflight.json").write_text(json.dumps({"ok": True, "line": "passed: old"}))
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        await sup.apply((spec,))
        assert (await _first(reports, "running")).state == EngineState.STARTING
        gone = await reports.wait("g-0", EngineState.EXITED)
        assert gone.exit_code == EXIT_CODE
        assert gone.preflight == "failed: bus bandwidth 0.4 GB/s is below 10 GB/s"
        assert not any(r.preflight == "passed: old" for r in reports.seen)
        nursery.cancel_scope.cancel()

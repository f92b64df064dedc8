"""An adopted engine that dies is noticed within a second (issue 11, item "found while
checking by hand"): the agent that adopts it is not its parent and cannot wait() for it,
so it watches a pidfd, readable the moment the process exits. A plain process stands in
for the engine, so this runs in the fast tier."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from cattrs.preconf.json import make_converter

from fakes.engines import free_port
from fakes.live import wait_for
from llmgw.agent.process import procs
from llmgw.model.engine import EngineKind, EngineSpec

SUPERVISOR_PROC = str(Path(__file__).resolve().parents[1] / "fakes" / "supervisor_proc.py")


def _start(work: Path, desired: Path, out: Path) -> subprocess.Popen[bytes]:
    with out.open("ab") as f:
        return subprocess.Popen([sys.executable, SUPERVISOR_PROC, str(work), str(desired)],
                                stdout=f, stderr=subprocess.STDOUT)


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.kill()
        p.wait(timeout=10)


def test_adopted_engine_death_is_noticed_within_a_second(tmp_path: Path) -> None:
    rid = f"adopt-exit-{os.getpid()}"
    spec = EngineSpec(rid, 1, "dep", "org/sim", "m", EngineKind.SIMULATED, (), free_port(),
                      env={"LLMGW_SIM_TTFT": "0.01"}, startup_timeout=30)
    desired = tmp_path / "desired.json"
    desired.write_text(json.dumps({"stop_timeout": 2.0,
                                   "engines": make_converter().unstructure((spec,))}))
    work = tmp_path / "work"
    first_out, second_out = tmp_path / "first.log", tmp_path / "second.log"
    first = _start(work, desired, first_out)
    second: subprocess.Popen[bytes] | None = None
    engine = 0
    try:
        wait_for(lambda: f"report {rid} ready" in first_out.read_text(), 30, "engine ready")
        engine = int(first_out.read_text().split(f"report {rid} ready pid=")[1].split()[0])
        _stop(first)  # SIGKILL: the engine is now nobody's child that can wait for it
        second = _start(work, desired, second_out)
        wait_for(lambda: "applied" in second_out.read_text(), 30, "second supervisor adopted")
        assert f"report {rid} ready pid={engine}" in second_out.read_text()
        os.kill(engine, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: f"report {rid} exited" in second_out.read_text(), 5, "exit noticed",
                 interval=0.02)
        assert time.monotonic() - killed < 1.0, second_out.read_text()
        assert procs.start_time(engine) is None
    finally:
        for p in (first, second):
            if p is not None:
                _stop(p)
        if engine and procs.start_time(engine) is not None:
            os.kill(engine, signal.SIGKILL)


LEFTOVER = (
    "import signal, subprocess, sys, time\n"
    # A session member that ignores SIGTERM, as vLLM's EngineCore can for seconds.
    "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
    "time.sleep(60)\n"
)


async def test_leader_death_is_not_ready_before_its_session_is_cleaned_up(tmp_path: Path) -> None:
    import trio

    from fakes.supervision import Reports
    from fakes.supervisor_proc import config
    from llmgw.agent.engines import LaunchPlan, ProcessPlan
    from llmgw.agent.lifecycle.supervisor import Supervisor
    from llmgw.model.engine import EngineState

    rid = f"leftover-{os.getpid()}"
    spec = EngineSpec(rid, 1, "dep", "org/plain", "m", EngineKind.SIMULATED, (), free_port(),
                      startup_timeout=30)

    def plan(_: EngineSpec, __: Mapping[str, int]) -> LaunchPlan:
        return LaunchPlan((ProcessPlan("engine", (sys.executable, "-c", LEFTOVER)),),
                          health_checked=False)

    cfg = config(str(tmp_path), stop_timeout=2.0)
    async with trio.open_nursery() as nursery:
        first = Reports()
        sup = Supervisor(cfg, first, plan=plan)
        await nursery.start(sup.serve)
        await sup.apply((spec,))
        pid = (await first.wait(rid, EngineState.READY)).pid
        nursery.cancel_scope.cancel()
    try:
        with trio.fail_after(5):  # the leftover member is up
            while len(procs.session_pids(pid)) < 2:
                await trio.sleep(0.05)
        second = Reports()
        async with trio.open_nursery() as nursery:
            sup2 = Supervisor(cfg, second, plan=plan)
            await nursery.start(sup2.serve)
            assert (await second.wait(rid, EngineState.READY)).pid == pid
            os.kill(pid, signal.SIGKILL)
            killed = trio.current_time()
            await second.wait(rid, EngineState.UNHEALTHY, timeout=1.0)
            assert trio.current_time() - killed < 1.0
            await second.wait(rid, EngineState.EXITED, timeout=10)  # after the member's SIGKILL
            assert procs.session_pids(pid) == []
            nursery.cancel_scope.cancel()
    finally:
        procs.signal_session(pid, signal.SIGKILL)

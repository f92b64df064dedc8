"""A stalled start on real processes (issue 30 item 5): an engine that only prints vLLM's
"No available shared memory broadcast block found in 60 seconds" line is given up on
after its startup_timeout, not the startup_max cap; one that prints loading lines between
them is still given its time. The supervisor reads the new log bytes itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from test_supervisor_gpus import cfg, prefix, spec  # noqa: F401  (prefix: a fixture)

from fakes.supervision import PlanLog, Reports
from llmgw.agent.lifecycle.supervisor import Supervisor
from llmgw.model.engine import EngineSpec, EngineState

WAIT = ("(EngineCore_DP0 pid=1) INFO 12-05 16:00:00 [shm_broadcast.py:750] No available shared "
        "memory broadcast block found in 60 seconds. This typically happens when some processes "
        "are hanging or doing some time-consuming work (e.g. compilation, weight/kv cache quantization).")
STALLED = ("sh", "-c", f"while true; do echo '{WAIT}'; sleep 0.2; done")
LOADING = ("sh", "-c", f"for i in $(seq 15); do echo '{WAIT}'; echo loading $i; sleep 0.2; done; "
                       "exec sleep 60")


async def _fails(tmp_path: Path, s: EngineSpec, argv: tuple[str, ...],
                 monkeypatch: pytest.MonkeyPatch, **sup: float) -> tuple[float, str]:
    """Seconds from apply until `argv` as an engine that never answers health is given
    up on, and why."""
    async def never(*args: object, **kwargs: object) -> bool:
        return False

    reports = Reports()
    sv = Supervisor(cfg(tmp_path, health_interval=0.1, **sup), reports, plan=PlanLog(argv, health=True),
                    health_probe=never)
    async with trio.open_nursery() as nursery:
        await nursery.start(sv.serve)
        t0 = trio.current_time()
        await sv.apply((s,))
        r = await reports.wait(s.replica_id, EngineState.FAILED, timeout=40)
        took = trio.current_time() - t0
        await reports.wait(s.replica_id, EngineState.EXITED, timeout=10)
        nursery.cancel_scope.cancel()
    return took, r.reason


async def test_waiting_lines_alone_do_not_hold_the_start_until_the_cap(
        tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    took, reason = await _fails(tmp_path, spec(f"{prefix}w", startup_timeout=1.0), STALLED,
                                monkeypatch, startup_max=30.0)
    assert took < 10.0, took  # before: 30 s, the cap (the lines counted as progress)
    assert reason.startswith("not ready within ") and "the log saying only that it waits" in reason, reason


async def test_loading_lines_between_them_still_extend(
        tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    took, reason = await _fails(tmp_path, spec(f"{prefix}l", startup_timeout=1.0), LOADING,
                                monkeypatch, startup_max=30.0)
    assert took >= 3.0, took  # 3 s of loading lines, then 1 s of nothing
    assert "(no progress for 1s)" in reason, reason

"""Adoption of pending records (the agent died between spawn and the completed record)."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import trio

from llmgw.agent.lifecycle.adopt import Adopted, Gone, adopt_records
from llmgw.agent.lifecycle.records import EngineRecord, read_records, write_record
from llmgw.agent.process import procs
from llmgw.model.engine import EngineKind, EngineSpec


def spec(rid: str) -> EngineSpec:
    return EngineSpec(rid, 3, "dep", "org/m", "m", EngineKind.SIMULATED, (), 1)


def _spawn_tagged(tmp_path: Path, tag: str) -> int:
    env = {**os.environ, procs.REPLICA_ENV: tag}
    return procs.spawn(["sleep", "60"], env=env, cwd=None, log_path=str(tmp_path / "x.log"))


async def test_pending_record_completed_from_tagged_process(tmp_path: Path) -> None:
    rid = f"p{uuid.uuid4().hex[:8]}"
    pid = _spawn_tagged(tmp_path, procs.replica_tag(rid, 3))
    started = procs.start_time(pid) or 0
    try:
        write_record(str(tmp_path), EngineRecord(spec(rid), str(tmp_path / "x.log")))
        found = await adopt_records(str(tmp_path))
        assert len(found) == 1 and isinstance(found[0], Adopted)
        rec = found[0].record
        assert (rec.pid, rec.sid, rec.start_time) == (pid, pid, procs.start_time(pid))
        assert read_records(str(tmp_path)) == [rec]
    finally:
        os.kill(pid, signal.SIGKILL)
        assert await procs.wait_exit(pid, started) == -signal.SIGKILL


async def test_pending_record_without_process_is_dropped(tmp_path: Path) -> None:
    write_record(str(tmp_path), EngineRecord(spec(f"q{uuid.uuid4().hex[:8]}"), "nolog"))
    assert await adopt_records(str(tmp_path)) == []
    assert read_records(str(tmp_path)) == []


async def test_gone_leader_leftover_session_members_are_stopped(tmp_path: Path) -> None:
    # a session whose leader exited but left a member behind (a worker, a raylet)
    rid = f"g{uuid.uuid4().hex[:8]}"
    leader = procs.spawn(["sh", "-c", "sleep 60 & exit 0"], env=dict(os.environ), cwd=None,
                         log_path=str(tmp_path / "x.log"))
    started = procs.start_time(leader) or 0
    assert await procs.wait_exit(leader, started) == 0
    with trio.fail_after(5):
        while not procs.session_pids(leader):
            await trio.sleep(0.01)
    write_record(str(tmp_path), EngineRecord(spec(rid), "nolog").completed(
        leader, leader, started))
    found = await adopt_records(str(tmp_path))
    assert len(found) == 1 and isinstance(found[0], Gone)
    assert procs.session_pids(leader) == []

"""Engines prove who they are (issue 10, item 2): a port held by another process is never
an engine's health. With real processes on 127.0.0.1: a plain HTTP server (python's
http.server, which answers GET /health with 200 from a file named `health`) holds the
port; the supervisor, and then a real server and agent, must not take its 200 for ready.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from fakes.engines import free_port
from fakes.live import Cluster, engine_pids, wait_for
from fakes.supervision import Reports
from fakes.supervisor_proc import config
from llmgw.agent.lifecycle.supervisor import Supervisor
from llmgw.agent.process import ports
from llmgw.model.engine import EngineKind, EngineSpec, EngineState

FAST = {"LLMGW_SIM_TTFT": "0.01", "LLMGW_SIM_TOKENS_PER_SECOND": "1000"}


class Holder:
    """`python -m http.server PORT` on 127.0.0.1, answering 200 to GET /health."""

    def __init__(self, root: Path, port: int) -> None:
        root.mkdir(parents=True, exist_ok=True)
        (root / "health").write_text("ok\n")
        self.port = port
        self.log = root / "holder.log"
        with self.log.open("ab") as f:
            self.p = subprocess.Popen(
                [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                 "--directory", str(root)], stdout=f, stderr=subprocess.STDOUT)
        wait_for(lambda: not ports.port_free("127.0.0.1", port) or self.p.poll() is not None,
                 10, "the holder to listen", interval=0.05)
        assert self.p.poll() is None, self.log.read_text()

    @property
    def pid(self) -> int:
        return self.p.pid

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=10)


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[list[Holder]]:
    started: list[Holder] = []
    yield started
    for h in started:
        h.stop()


def spec(rid: str, port: int, **env: str) -> EngineSpec:
    return EngineSpec(rid, 1, "dep", "org/sim", f"m-{rid}", EngineKind.SIMULATED, (), port,
                      env={**FAST, **env}, startup_timeout=30)


def test_shell_sees_the_holder_and_its_command(tmp_path: Path, holders: list[Holder]) -> None:
    port = free_port()
    assert ports.port_free("127.0.0.1", port)
    h = Holder(tmp_path / "h", port)
    holders.append(h)
    assert not ports.port_free("127.0.0.1", port)
    conflict = ports.taken_by("127.0.0.1", port)
    assert conflict.holders and conflict.holders[0][0] == h.pid
    assert "http.server" in conflict.reason and f"pid {h.pid}" in conflict.reason
    # Not the holder's session: a conflict. Its own session: none.
    assert ports.owner_conflict("127.0.0.1", port, sid=1) is not None
    assert ports.owner_conflict("127.0.0.1", port, sid=os.getsid(h.pid)) is None


async def test_port_taken_before_start_is_reported_and_nothing_started(
        tmp_path: Path, holders: list[Holder]) -> None:
    port = free_port()
    h = Holder(tmp_path / "h", port)
    holders.append(h)
    reports = Reports()
    sup = Supervisor(config(str(tmp_path / "work")), reports)
    s = spec("taken-0", port)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        await sup.apply((s,))
        r = await reports.wait(s.replica_id, EngineState.EXITED, timeout=5)
        assert r.conflict_port == port and r.pid == 0
        assert r.reason.startswith(f"not started: port {port} is in use by pid {h.pid} (")
        assert [x.state for x in reports.seen] == [EngineState.EXITED]
        assert engine_pids(tmp_path / "work") == {}
        nursery.cancel_scope.cancel()


async def test_another_process_answering_health_is_a_conflict_never_ready(
        tmp_path: Path, holders: list[Holder]) -> None:
    port = free_port()
    reports = Reports()
    sup = Supervisor(config(str(tmp_path / "work"), stop_timeout=2.0), reports)
    # The engine "loads" for 3 s before it listens: the holder takes the port meanwhile
    # (after the agent found it free), so the engine's own bind will fail.
    s = spec("stolen-0", port, LLMGW_SIM_LOAD_SECONDS="3")
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        await sup.apply((s,))
        await reports.wait(s.replica_id, EngineState.STARTING, timeout=5)
        h = Holder(tmp_path / "h", port)
        holders.append(h)
        r = await reports.wait(s.replica_id, EngineState.EXITED, timeout=15)
        assert EngineState.READY not in [x.state for x in reports.seen]
        assert r.conflict_port == port
        assert f"port {port} is in use by pid {h.pid}" in r.reason
        assert engine_pids(tmp_path / "work") == {}
        nursery.cancel_scope.cancel()


async def test_own_engine_is_ready_and_checked(tmp_path: Path) -> None:
    port = free_port()
    reports = Reports()
    sup = Supervisor(config(str(tmp_path / "work")), reports)
    s = spec("own-0", port)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        await sup.apply((s,))
        r = await reports.wait(s.replica_id, EngineState.READY, timeout=15)
        assert r.conflict_port == 0
        await sup.apply(())
        nursery.cancel_scope.cancel()


@pytest.mark.slow
def test_agent_reports_the_conflict_and_never_serves_the_holder(
        tmp_path: Path, holders: list[Holder]) -> None:
    c = Cluster(tmp_path / "c")
    try:
        c.start_server()
        lo = free_port()
        # Placement gives the lowest free port of the node's range first: hold it.
        h = Holder(tmp_path / "h", lo)
        holders.append(h)
        agent = c.start_agent("n1", discovery={"simulated_gpus": 2}, port_range=[lo, lo + 20])
        c.wait_states({"n1": "ready"})
        f = tmp_path / "demo.yaml"
        f.write_text("name: demo\nmodel: org/demo\nengine: simulated\ngpus_per_node: 1\n"
                     "replicas: 1\n")
        r = c.ctl("apply", "-f", str(f))
        assert r.returncode == 0, r.stderr
        wait_for(lambda: f"port {lo} is in use by pid {h.pid}" in agent.text(), 30,
                 "the agent to report the conflict")
        assert "Traceback" not in agent.text()

        def rows() -> list[dict[str, object]]:
            out = c.ctl("get", "replicas", "-o", "json")
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)

        # For a while: never ready on the held port, no engine started on it.
        seen_reasons: set[str] = set()
        until = time.monotonic() + 10
        while time.monotonic() < until:
            now_rows = rows()
            seen_reasons |= {str(row["reason"]) for row in now_rows}
            for row in now_rows:
                if row["endpoint"] == f"http://127.0.0.1:{lo}":
                    assert row["state"] != "ready", row
            for pid, tag in engine_pids(tmp_path / "c").items():
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                assert str(lo).encode() not in cmd, (pid, tag, cmd)
            if any(row["state"] == "ready" for row in now_rows):
                break  # re-placed on another port (the reconcile side's part)
            time.sleep(0.5)
        ready = [row for row in rows() if row["state"] == "ready"]
        for row in ready:
            assert row["endpoint"] != f"http://127.0.0.1:{lo}"
    finally:
        c.close()

"""vLLM's `launch_mode: ray` run for real on loopback: two supervisors (one per "node"),
`ray start --head` and a joining worker from the real launch plan, the simulated engine
standing in for `vllm serve`, then a stop that leaves no Ray process behind.

Needs the optional `ray` package (`pip install 'llmgw[ray]'`); skipped where it is absent.
Ray is heavy (a head and a worker: gcs_server, two raylets, their agents): one run at a
time, every wait bounded.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from fakes.engines import free_port
from fakes.supervision import Reports, chat
from llmgw.agent.engines import build_plan, count_ray_nodes
from llmgw.agent.lifecycle.supervisor import Supervisor
from llmgw.agent.process import procs
from llmgw.config.agent import AgentConfig, EnginesConfig, KeysConfig, SupervisorConfig, VllmConfig
from llmgw.model.deployment import RAY_PORT_BLOCK
from llmgw.model.engine import EngineKind, EngineReport, EngineSpec, EngineState, GangSpec

pytestmark = [pytest.mark.ray, pytest.mark.slow]

pytest.importorskip("ray", reason="needs the optional ray package: pip install 'llmgw[ray]'")


RAY_BIN = str(Path(sys.executable).parent / "ray")
FAST = {"LLMGW_SIM_TTFT": "0.01", "LLMGW_SIM_TOKENS_PER_SECOND": "1000", "LLMGW_SIM_LOAD_SECONDS": "0.5"}
STARTUP = 150.0  # seconds for two Ray nodes and the engine on a small, busy machine
STOP = 30.0  # supervisor stop_timeout: SIGTERM, then SIGKILL to the session


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_block(avoid: list[int]) -> int:
    """The first port of RAY_PORT_BLOCK free ports on loopback, clear of `avoid`."""
    for _ in range(500):
        base = random.randrange(20000, 60000 - RAY_PORT_BLOCK, RAY_PORT_BLOCK)
        if any(base <= p < base + RAY_PORT_BLOCK for p in avoid):
            continue
        if all(_bindable(base + i) for i in range(RAY_PORT_BLOCK)):
            return base
    raise RuntimeError("no free block of ports for Ray")


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ")
    except OSError:
        return b""


def _environ(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def _leftovers(tag: str, paths: list[str]) -> dict[int, str]:
    """Live processes of this test: tagged with its replica id, or naming one of its dirs."""
    needle = f"{procs.REPLICA_ENV}={tag}".encode()
    marks = [p.encode() for p in paths]
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        pid = int(name)
        cmd = _cmdline(pid)
        if not cmd or procs.start_time(pid) is None:
            continue  # gone, or a zombie
        if any(e.startswith(needle) for e in _environ(pid)) or any(m in cmd for m in marks):
            found[pid] = cmd.decode(errors="replace")[:200]
    return found


def _config(work_dir: Path, node: str, shim: Path) -> AgentConfig:
    return AgentConfig(
        node_id=node, server="tcp://127.0.0.1:1", keys=KeysConfig("s", "p"),
        mgmt_addr="127.0.0.1", mgmt_interface="lo",
        engines=EnginesConfig(vllm=VllmConfig(bin=str(shim), launch_mode="ray", ray_bin=RAY_BIN)),
        supervisor=SupervisorConfig(work_dir=str(work_dir), log_lines=60, stop_timeout=STOP,
                                    health_interval=0.5),
    )  # fmt: skip


def _shim(tmp_path: Path) -> Path:
    """Stands for `vllm`: execs the simulated engine with vLLM's argv."""
    path = tmp_path / "vllm"
    path.write_text(f'#!/bin/sh\nexec {sys.executable} -m llmgw.simengine "$@"\n')
    path.chmod(0o755)
    return path


class Cluster:
    """What this test started, for the last-resort cleanup (by pid, never by name)."""

    def __init__(self, tag: str, paths: list[str]) -> None:
        self.tag = tag
        self.paths = paths


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(f"t{uuid.uuid4().hex[:8]}-ray", [str(tmp_path)])
    yield c
    left = _leftovers(c.tag, c.paths)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    for path in c.paths:
        if path.startswith("/tmp/llmgw-ray-"):
            shutil.rmtree(path, ignore_errors=True)


def _ray_status(spec: EngineSpec) -> str:
    assert spec.gang is not None
    argv = [RAY_BIN, "status", f"--address={spec.gang.head_addr}:{spec.gang.ray_port}"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout


def _log(work_dir: Path, rid: str) -> str:
    path = work_dir / "engines" / rid / "engine.log"
    return path.read_text(errors="replace")[-6000:] if path.exists() else "(no log)"


async def _wait_state(
    reports: Reports, rid: str, state: EngineState, timeout: float, logs: list[Path]
) -> EngineReport:
    try:
        return await reports.wait(rid, state, timeout=timeout)
    except trio.TooSlowError:
        seen = [f"{r.state} {r.reason}" for r in reports.seen if r.replica_id == rid]
        text = "\n".join(f"--- {p}\n{_log(p, rid)}" for p in logs)
        pytest.fail(f"{rid} never {state} in {timeout}s; reports {seen}\n{text}")


async def test_ray_plan_runs_on_loopback_and_stops_clean(tmp_path: Path, cluster: Cluster) -> None:
    shim = _shim(tmp_path)
    work = [tmp_path / "node0", tmp_path / "node1"]
    http, gcs, rdv = free_port(), free_port(), free_port()
    base0 = _free_block([http, gcs, rdv])
    base1 = _free_block([http, gcs, rdv, *range(base0, base0 + RAY_PORT_BLOCK)])
    rid = cluster.tag
    specs = [
        EngineSpec(rid, 1, "dep", "org/sim", "m-ray", EngineKind.VLLM, (), http, env=dict(FAST),
                   startup_timeout=STARTUP,
                   gang=GangSpec(2, rank, "127.0.0.1", rdv, ray_port=gcs, ray_port_base=base))
        for rank, base in ((0, base0), (1, base1))
    ]  # fmt: skip
    configs = [_config(work[i], f"node{i}", shim) for i in range(2)]
    # The Ray temp dirs the plans chose (tmp_path is too long for Ray's sockets).
    temp_dirs = []
    for s, c, w in zip(specs, configs, work, strict=True):
        (start,) = [
            p
            for p in build_plan(s, c, str(w), python=sys.executable, gpu_indices={}).processes
            if p.name.startswith("ray-")
        ]
        temp_dirs.append(next(a.split("=", 1)[1] for a in start.argv if a.startswith("--temp-dir=")))
    cluster.paths += temp_dirs
    for d in temp_dirs:
        assert len(d) <= 40, d

    reports = [Reports(), Reports()]
    sups = [Supervisor(configs[i], reports[i]) for i in range(2)]
    t0 = time.monotonic()
    async with trio.open_nursery() as nursery:
        for sup in sups:
            await nursery.start(sup.serve)
        try:
            await sups[1].apply((specs[1],))
            await sups[0].apply((specs[0],))
            ready = await _wait_state(reports[0], rid, EngineState.READY, STARTUP + 10, work)
            started = time.monotonic() - t0
            # The worker member is alive (liveness only) and the cluster counts both nodes.
            assert not [r for r in reports[1].seen if r.state in (EngineState.EXITED, EngineState.FAILED)]
            status = await trio.to_thread.run_sync(_ray_status, specs[0])
            assert count_ray_nodes(status) == 2, status
            # Ray took --num-cpus (no GPUs: the margin of 2 per node), not the host's cores.
            assert "/4.0 CPU" in status, status
            # What the final check must not find afterwards is really there now.
            running = " ".join(_leftovers(rid, cluster.paths).values())
            for daemon in ("gcs_server", "raylet", "ray start --head", "ray start --address"):
                assert daemon in running, f"no {daemon} among {running}"
            assert ready.endpoint == f"http://127.0.0.1:{http}"
            assert await trio.to_thread.run_sync(chat, http, "m-ray") == 200
            log0 = _log(work[0], rid)
            assert "Ray cluster counts 2 of 2 nodes" in log0, log0
        finally:
            t1 = time.monotonic()
            with trio.move_on_after(2 * STOP + 30) as cs:
                cs.shield = True
                await sups[0].apply(())
                await sups[1].apply(())
            stopped = time.monotonic() - t1
            nursery.cancel_scope.cancel()
    assert not cs.cancelled_caught, "stopping the Ray members took too long"
    for i in range(2):
        assert reports[i].seen[-1].replica_id == rid and reports[i].seen[-1].state is EngineState.EXITED

    # Nothing of this replica is left: no tagged process, no Ray daemon naming our dirs.
    deadline = time.monotonic() + 10
    left = _leftovers(rid, cluster.paths)
    while left and time.monotonic() < deadline:
        await trio.sleep(0.2)
        left = _leftovers(rid, cluster.paths)
    assert left == {}, f"left behind after stop: {left}"
    print(f"ray members ready in {started:.1f}s, stopped in {stopped:.1f}s")

"""The supervisor on GPUs (issue 18), with a fake GPU reader and plain processes as
engines: the pre-spawn check and CUDA indices, release after a stop, the probe timeout
and the startup deadline that follows progress."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import trio
from attrs import evolve

from fakes.engines import free_port
from fakes.supervision import GIB, FakeGpus, PlanLog, Reports, gpu
from fakes.supervisor_proc import config
from llmgw.agent.gpus.memory import GpuMemory
from llmgw.agent.lifecycle.records import LOG, read_records
from llmgw.agent.lifecycle.supervisor import Supervisor
from llmgw.agent.process import procs
from llmgw.config.agent import AgentConfig
from llmgw.model.engine import EngineKind, EngineSpec, EngineState


@pytest.fixture
def prefix() -> Iterator[str]:
    """A tag prefix for this test's engines; any a failed test left are killed by pid."""
    p = f"g{uuid.uuid4().hex[:8]}-"
    yield p
    needle = f"{procs.REPLICA_ENV}={p}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(needle) for e in env):
            try:
                os.kill(int(name), signal.SIGKILL)
            except ProcessLookupError:
                continue


def cfg(tmp_path: Path, **sup: float) -> AgentConfig:
    c = config(str(tmp_path), stop_timeout=2.0)
    return evolve(c, supervisor=evolve(c.supervisor, **sup))


def spec(rid: str, *gpus: str, gen: int = 1, engine: EngineKind = EngineKind.VLLM,
         startup_timeout: float = 30.0, port: int = 0) -> EngineSpec:
    return EngineSpec(rid, gen, "dep", "org/m", "m", engine, gpus, port or free_port(),
                      startup_timeout=startup_timeout)


class LiveGpus(FakeGpus):
    """Like NVML: a process is listed on its GPU only while it is alive."""

    def __call__(self) -> Mapping[str, GpuMemory] | None:
        got = super().__call__()
        if got is None:
            return None
        for u in list(self.gpus):
            for p in self.gpus[u].processes:
                if procs.state_of(p.pid) in (None, "Z"):
                    self.drop(u, p.pid)
        return dict(self.gpus)


async def _refused(tmp_path: Path, s: EngineSpec, reader: FakeGpus | None) -> str:
    reports = Reports()
    plan = PlanLog()
    sup = Supervisor(cfg(tmp_path), reports, plan=plan, gpu_memory=reader)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        await sup.apply((s,))
        r = reports.last(s.replica_id)
        nursery.cancel_scope.cancel()
    assert r is not None and r.state is EngineState.EXITED and r.pid == 0
    assert plan.calls == []  # refused before any plan or process
    assert r.log_tail and r.log_tail[-1] == f"llmgw agent: {r.reason}"  # in `ctl logs` too
    return r.reason


async def test_refused_when_a_gpu_is_not_on_the_node(tmp_path: Path, prefix: str) -> None:
    got = await _refused(tmp_path, spec(f"{prefix}a", "GPU-a", "GPU-x"), FakeGpus(gpu("GPU-a", 0)))
    assert got == "not started: GPU GPU-x is not on this node now"


async def test_refused_when_held_by_a_foreign_process(tmp_path: Path, prefix: str) -> None:
    gpus = FakeGpus(gpu("GPU-a", 0), gpu("GPU-b", 3))
    gpus.hold("GPU-b", 4242, 61 * GIB, "python train.py")
    got = await _refused(tmp_path, spec(f"{prefix}a", "GPU-a", "GPU-b"), gpus)
    assert got == "not started: GPU 3 held by pid 4242 (python train.py), 61 GiB"


async def test_refused_when_unhealthy(tmp_path: Path, prefix: str) -> None:
    gpus = FakeGpus(gpu("GPU-a", 1, problems=("2 volatile uncorrected ECC errors",)))
    got = await _refused(tmp_path, spec(f"{prefix}a", "GPU-a"), gpus)
    assert got == "not started: GPU 1 (GPU-a) is unhealthy: 2 volatile uncorrected ECC errors"


async def test_refused_without_a_way_to_read_the_gpus(tmp_path: Path, prefix: str) -> None:
    got = await _refused(tmp_path, spec(f"{prefix}a", "GPU-a"), None)
    assert got == "not started: no GPU reader on this agent to map GPUs GPU-a to CUDA devices"
    gone = FakeGpus(gpu("GPU-a", 0))
    gone.fail = True
    got = await _refused(tmp_path, spec(f"{prefix}b", "GPU-a"), gone)
    assert got == "not started: cannot read the GPUs (NVML) to map GPU-a to CUDA devices"


async def test_started_with_nvml_indices_recorded_and_logged(tmp_path: Path, prefix: str) -> None:
    gpus = LiveGpus(gpu("GPU-a", 3), gpu("GPU-b", 0))
    reports = Reports()
    plan = PlanLog()
    changed: list[frozenset[int]] = []
    sup: Supervisor
    sup = Supervisor(cfg(tmp_path), reports, plan=plan, gpu_memory=gpus,
                     on_gpus_changed=lambda: changed.append(sup.engine_pids()))
    s = spec(f"{prefix}a", "GPU-a", "GPU-b")
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        await sup.apply((s,))
        r = await reports.wait(s.replica_id, EngineState.READY)
        assert plan.calls == [(s, {"GPU-a": 3, "GPU-b": 0})]
        (rec,) = read_records(str(tmp_path))
        assert rec.cuda_devices == (3, 0) and rec.spec.gpus == ("GPU-a", "GPU-b")
        # What "its memory is back" means after it ends, kept for an adopted engine too.
        assert rec.gpu_free_before == (gpus.gpus["GPU-a"].free, gpus.gpus["GPU-b"].free)
        log_text = (tmp_path / "engines" / s.replica_id / LOG).read_text()
        assert "llmgw agent: GPUs GPU-a,GPU-b as CUDA devices 3,0\n" in log_text
        assert r.pid in sup.engine_pids()
        assert changed and r.pid in changed[-1]
        # Stopped: nothing left on the GPUs (LiveGpus drops the dead), so released at once.
        await sup.apply(())
        with trio.fail_after(5):
            while sup.releasing():
                await trio.sleep(0.05)
        assert r.pid not in sup.engine_pids()
        nursery.cancel_scope.cancel()


async def test_gpus_release_only_once_the_memory_is_back(tmp_path: Path, prefix: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's process is gone but the driver still lists it (stuck): its GPU stays
    releasing, a start placed there meanwhile is refused, and once the memory is back the
    GPU is released and the start goes through."""
    gpus = FakeGpus(gpu("GPU-a", 3))
    reports = Reports()
    changes: list[dict[str, str]] = []
    sup: Supervisor
    sup = Supervisor(cfg(tmp_path), reports, plan=PlanLog(), gpu_memory=gpus,
                     on_gpus_changed=lambda: changes.append(sup.releasing()))
    sup.releases.start_wait = 0.3
    first = spec(f"{prefix}a", "GPU-a")
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        await sup.apply((first,))
        r = await reports.wait(first.replica_id, EngineState.READY)
        gpus.hold("GPU-a", r.pid, 70 * GIB, "vllm serve")  # what NVML would list
        await sup.apply(())
        assert procs.start_time(r.pid) is None  # the process is gone...
        with trio.fail_after(5):
            while "pid" not in sup.releasing().get("GPU-a", ""):
                await trio.sleep(0.05)
        # ...but its memory is not back
        assert sup.releasing() == {
            "GPU-a": f"releasing after {first.replica_id} stopped: pid {r.pid} holds 70 GiB"}
        other = spec(f"{prefix}b", "GPU-a")
        await sup.apply((other,))
        refused = reports.last(other.replica_id)
        assert refused is not None and refused.state is EngineState.EXITED
        assert refused.reason == (f"not started: GPU 3 is releasing: releasing after "
                                  f"{first.replica_id} stopped: pid {r.pid} holds 70 GiB")
        gpus.drop("GPU-a", r.pid)
        with trio.fail_after(5):
            while sup.releasing():
                await trio.sleep(0.05)
        assert changes[-1] == {}
        again = evolve(other, generation=2)
        await sup.apply((again,))
        await reports.wait(again.replica_id, EngineState.READY, generation=2)
        await sup.apply(())
        nursery.cancel_scope.cancel()


async def test_a_restart_on_the_same_gpus_waits_for_a_quick_release(tmp_path: Path,
                                                                   prefix: str) -> None:
    """A new generation replacing the old on its GPUs: the old process's memory comes back
    as soon as it is gone, and the new one starts in the same apply, not refused."""
    gpus = LiveGpus(gpu("GPU-a", 3))
    reports = Reports()
    sup = Supervisor(cfg(tmp_path), reports, plan=PlanLog(), gpu_memory=gpus)
    s1 = spec(f"{prefix}a", "GPU-a")
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        await sup.apply((s1,))
        r = await reports.wait(s1.replica_id, EngineState.READY)
        gpus.hold("GPU-a", r.pid, 70 * GIB, "vllm serve")
        s2 = evolve(s1, generation=2)
        await sup.apply((s2,))
        r2 = await reports.wait(s1.replica_id, EngineState.READY, generation=2)
        assert r2.pid != r.pid
        await sup.apply(())
        nursery.cancel_scope.cancel()


async def test_probe_timeout_is_the_setting_and_longer_for_sglang(
        tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[float] = []

    async def fake_health(host: str, port: int, *, timeout: float = 2.0, path: str = "",
                          key: str = "") -> bool:
        asked.append(timeout)
        return True

    reports = Reports()
    sup = Supervisor(cfg(tmp_path, health_timeout=7.0), reports, plan=PlanLog(health=True),
                     health_probe=fake_health)
    vllm = spec(f"{prefix}v")
    sglang = spec(f"{prefix}s", engine=EngineKind.SGLANG)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        await sup.apply((vllm, sglang))
        await reports.wait(vllm.replica_id, EngineState.READY)
        await reports.wait(sglang.replica_id, EngineState.READY)
        assert sorted(set(asked)) == [7.0, 25.0]  # was min(5, max(0.5, health_interval))
        await sup.apply(())
        nursery.cancel_scope.cancel()


LOADING = ("sh", "-c", "for i in $(seq 30); do echo loading $i; sleep 0.1; done; exec sleep 60")


async def _fails(tmp_path: Path, s: EngineSpec, argv: tuple[str, ...], monkeypatch: pytest.MonkeyPatch,
                 *, size: int = 0, **sup: float) -> tuple[float, str]:
    async def never(host: str, port: int, *, timeout: float = 2.0, path: str = "",
                    key: str = "") -> bool:
        return False

    reports = Reports()
    sv = Supervisor(cfg(tmp_path, health_interval=0.1, **sup), reports,
                    plan=PlanLog(argv, health=True), model_size=lambda model: size,
                    health_probe=never)
    async with trio.open_nursery() as nursery:
        await nursery.start(sv.serve)
        t0 = trio.current_time()
        await sv.apply((s,))
        r = await reports.wait(s.replica_id, EngineState.FAILED, timeout=20)
        took = trio.current_time() - t0
        await reports.wait(s.replica_id, EngineState.EXITED, timeout=10)
        nursery.cancel_scope.cancel()
    return took, r.reason


async def test_startup_deadline_extends_while_the_log_grows(tmp_path: Path, prefix: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """3 s of loading messages and a 1 s startup timeout: given up on 1 s after the last
    one, not 1 s after the spawn."""
    took, reason = await _fails(tmp_path, spec(f"{prefix}a", startup_timeout=1.0), LOADING,
                                monkeypatch)
    assert took >= 3.5
    assert reason.startswith("not ready within ") and "(no progress for 1s)" in reason


async def test_startup_deadline_cap(tmp_path: Path, prefix: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    took, reason = await _fails(tmp_path, spec(f"{prefix}a", startup_timeout=1.0), LOADING,
                                monkeypatch, startup_max=2.0)
    assert 2.0 <= took < 4.0
    assert reason == "not ready within 2s (the 2s cap)"


async def test_startup_floor_from_the_weights(tmp_path: Path, prefix: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """400 MB of weights at the assumed 200 MB/s: 2 s on top of a 1 s timeout, no progress."""
    took, reason = await _fails(tmp_path, spec(f"{prefix}a", startup_timeout=1.0),
                                ("sleep", "60"), monkeypatch, size=400 * 10**6)
    assert took >= 3.0
    assert "(no progress for 3s)" in reason

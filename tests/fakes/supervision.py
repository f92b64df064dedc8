"""What tests of the supervisor collect: its reports, and a chat request to an engine;
a GPU reader whose GPUs a test changes, and launch plans of plain processes."""

from __future__ import annotations

import http.client
import json
from collections.abc import Mapping

import trio
from attrs import evolve

from fakes.engine_keys import auth, engine_key
from llmgw.agent.engines import LaunchPlan, ProcessPlan
from llmgw.agent.gpus.memory import GpuMemory
from llmgw.model.engine import EngineReport, EngineSpec, EngineState
from llmgw.model.inventory import GpuProcess

GIB = 1024  # MiB


class FakeGpus:
    """A GpuMemoryReader over a dict the test mutates: `gpus[uuid] = GpuMemory(...)`.

    `fail = True` makes it answer None (NVML gone); `reads` counts the calls."""

    def __init__(self, *gpus: GpuMemory) -> None:
        self.gpus: dict[str, GpuMemory] = {g.uuid: g for g in gpus}
        self.fail = False
        self.reads = 0

    def __call__(self) -> Mapping[str, GpuMemory] | None:
        self.reads += 1
        return None if self.fail else dict(self.gpus)

    async def read(self) -> Mapping[str, GpuMemory] | None:
        """The same, as an awaitable (no thread: exact on an autojump clock)."""
        return self()

    def hold(self, uuid: str, pid: int, mib: int, command: str = "python train.py") -> None:
        """Process `pid` takes `mib` on `uuid`."""
        g = self.gpus[uuid]
        self.gpus[uuid] = evolve(g, free=g.free - mib,
                                 processes=(*g.processes, GpuProcess(pid, command, mib)))

    def drop(self, uuid: str, pid: int) -> None:
        """Process `pid` lets its memory on `uuid` go."""
        g = self.gpus[uuid]
        gone = sum(p.memory for p in g.processes if p.pid == pid)
        self.gpus[uuid] = evolve(g, free=g.free + gone,
                                 processes=tuple(p for p in g.processes if p.pid != pid))


def gpu(uuid: str, index: int, total_gib: int = 80, *, free: int | None = None,
        processes: tuple[GpuProcess, ...] = (), problems: tuple[str, ...] = ()) -> GpuMemory:
    """A GPU of `total_gib`, idle unless `free` (MiB) says otherwise."""
    total = total_gib * GIB
    return GpuMemory(uuid, index, total, total if free is None else free, processes, problems)


class PlanLog:
    """A two-argument launch plan of one liveness-only process (`sleep 600` by default)
    that keeps what it was asked with: the spec and the UUID -> index mapping."""

    def __init__(self, argv: tuple[str, ...] = ("sleep", "600"), health: bool = False) -> None:
        self.argv = argv
        self.health = health
        self.calls: list[tuple[EngineSpec, dict[str, int]]] = []

    def __call__(self, spec: EngineSpec, indices: Mapping[str, int]) -> LaunchPlan:
        self.calls.append((spec, dict(indices)))
        return LaunchPlan((ProcessPlan("engine", self.argv),), health_checked=self.health)


class Reports:
    """An on_report callback that keeps every report, in order."""

    def __init__(self) -> None:
        self.seen: list[EngineReport] = []

    def __call__(self, r: EngineReport) -> None:
        self.seen.append(r)

    def states(self) -> list[EngineState]:
        return [r.state for r in self.seen]

    def last(self, rid: str) -> EngineReport | None:
        mine = [r for r in self.seen if r.replica_id == rid]
        return mine[-1] if mine else None

    async def wait(self, rid: str, state: EngineState, timeout: float = 15,
                   generation: int | None = None) -> EngineReport:
        """The latest report of `rid` in `state` (of `generation`, when given), once there
        is one. Give the generation wherever an older one of the same replica may still
        report: its READY is not the new engine's."""
        with trio.fail_after(timeout):
            while True:
                for r in reversed(self.seen):
                    if r.replica_id == rid and r.state is state and generation in (None, r.generation):
                        return r
                await trio.sleep(0.05)


def chat(port: int, name: str, timeout: float = 10) -> int:
    """POST /v1/chat/completions to an engine on 127.0.0.1, with its own key; its status."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        body = json.dumps({"model": name, "messages": [{"role": "user", "content": "hi"}]})
        conn.request("POST", "/v1/chat/completions", body,
                     {"Content-Type": "application/json", **auth(engine_key(port))})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()

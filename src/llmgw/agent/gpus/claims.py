"""Who claims this node's GPUs: the check right before a spawn, and the inventory's view
of this agent's own engines. Pure: readings in, a verdict or an inventory out.

The server placed the engine on what the last inventory said; between that and the
spawn another process may have taken the memory, a GPU may have been lost or turned
unhealthy, or the previous engine's memory may not be back. vLLM refuses to start below
`--gpu-memory-utilization` x total free (vllm#20305, #25837): starting anyway only makes
a crash loop, so the supervisor refuses with the reason instead.
"""

from __future__ import annotations

from collections.abc import Mapping

from attrs import evolve

from llmgw.agent.gpus.memory import GpuMemory
from llmgw.agent.gpus.release import gib
from llmgw.model.engine import EngineSpec
from llmgw.model.gpu_need import memory_need
from llmgw.model.inventory import Inventory, hard_problems


def gpu_memory_min(spec: EngineSpec) -> int:
    """The deployment's `gpu_memory_min` (MiB), carried in the spec's origin; 0 when absent
    or not a count (an origin is the server's, but an old or odd one must not stop us)."""
    value = spec.origin.get("gpu_memory_min", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def check_gpus(
    spec: EngineSpec,
    reading: Mapping[str, GpuMemory],
    releasing: Mapping[str, str],
    own_pids: frozenset[int] = frozenset(),
) -> dict[str, int] | str:
    """The NVML index of each of `spec.gpus`, or why the engine must not start now.

    `own_pids`: processes of this very replica (an earlier session of it), never named
    as the holder that keeps it out.
    """
    indices: dict[str, int] = {}
    floor = gpu_memory_min(spec)
    for uuid in spec.gpus:
        gpu = reading.get(uuid)
        if gpu is None:
            return f"GPU {uuid} is not on this node now"
        # Hard problems only: a soft one keeps the server from placing new replicas here,
        # but one placed before (restarted after a crash, or started again) runs on.
        hard = hard_problems(gpu.problems)
        if hard:
            return f"GPU {gpu.index} ({uuid}) is unhealthy: {'; '.join(hard)}"
        why = releasing.get(uuid)
        if why:
            return f"GPU {gpu.index} is releasing: {why}"
        need = memory_need(spec.engine, spec.args, gpu.total, floor)
        if gpu.free < need:
            holders = [p for p in gpu.processes if p.pid not in own_pids and p.memory > 0]
            if holders:
                top = max(holders, key=lambda p: (p.memory, -p.pid))
                return f"GPU {gpu.index} held by pid {top.pid} ({top.command}), {gib(top.memory)}"
            return f"GPU {gpu.index} has {gib(gpu.free)} free, the engine needs {gib(need)}"
        indices[uuid] = gpu.index
    return indices


def mark_inventory(inv: Inventory, engine_pids: frozenset[int],
                   releasing: Mapping[str, str]) -> Inventory:
    """`inv` with this agent's engine processes dropped from each GPU's foreign processes,
    and each GPU's `releasing` set from the supervisor's (cleared where it has none)."""
    gpus = []
    changed = False
    for g in inv.gpus:
        procs = tuple(p for p in g.processes if p.pid not in engine_pids)
        why = releasing.get(g.uuid, "")
        if procs != g.processes or why != g.releasing:
            g = evolve(g, processes=procs, releasing=why)
            changed = True
        gpus.append(g)
    return evolve(inv, gpus=tuple(gpus)) if changed else inv

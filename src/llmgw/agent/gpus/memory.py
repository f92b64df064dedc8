"""What the supervisor reads about each GPU right before it spawns an engine, and after
one stops: NVML's index for the placed UUID, free memory, and who holds memory there.

The reader is blocking (NVML calls, or a copy of the last inventory where NVML is not
in use): the supervisor runs it in a thread. It returns None when it cannot read at all
(NVML gone since discovery); a GPU missing from its answer is not on the node now.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from attrs import frozen

from llmgw.model.inventory import GpuProcess, Inventory


@frozen
class GpuMemory:
    uuid: str
    index: int  # NVML's index, what CUDA_VISIBLE_DEVICES carries
    total: int  # MiB
    free: int  # MiB
    # Every compute process holding memory here, engines of this agent included.
    processes: tuple[GpuProcess, ...] = ()
    problems: tuple[str, ...] = ()  # as Gpu.problems


GpuMemoryReader = Callable[[], Mapping[str, GpuMemory] | None]


def from_inventory(inventory: Inventory) -> dict[str, GpuMemory]:
    """The last discovery's figures, for nodes where NVML is not what found the GPUs
    (nvidia-smi, simulated GPUs)."""
    return {g.uuid: GpuMemory(g.uuid, g.index, g.memory_total, g.memory_free, g.processes,
                              g.problems)
            for g in inventory.gpus}

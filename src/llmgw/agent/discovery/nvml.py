"""Read GPUs through NVML, over an injected pynvml-like object (the real one: `pynvml`).

Blocking: run it in `trio.to_thread`. The caller decides what to do when NVML is absent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from attrs import evolve

from llmgw.agent.discovery.nvidia_smi import GpuOutputError, normalise_bus_id
from llmgw.model.inventory import Gpu

log = logging.getLogger(__name__)

MIB = 1024 * 1024
# When the module does not say NVML_NVLINK_MAX_LINKS; links past the GPU's last raise.
MAX_LINKS = 18


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bus_id(pci: Any) -> str:
    raw = getattr(pci, "busId", None) or getattr(pci, "busIdLegacy", "")
    return normalise_bus_id(_text(raw))


def _nvlinks(nvml: Any, handle: Any) -> dict[str, int]:
    """Remote PCI bus id -> number of active links to it."""
    remote: dict[str, int] = {}
    enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
    max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", MAX_LINKS)
    for link in range(max_links):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) != enabled:
                continue
            bus = _bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link))
        except Exception as exc:  # NVMLError_NotSupported / InvalidArgument past the last
            log.debug("NVLink %d: %s", link, exc)
            continue
        remote[bus] = remote.get(bus, 0) + 1
    return remote


def _numa(nvml: Any, handle: Any, bus: str, numa_of: Callable[[str], int | None]) -> int | None:
    get = getattr(nvml, "nvmlDeviceGetNumaNodeId", None)
    if get is not None:
        try:
            node = int(get(handle))
            return node if node >= 0 else None
        except Exception as exc:
            log.debug("nvmlDeviceGetNumaNodeId(%s): %s; trying sysfs", bus, exc)
    return numa_of(bus)


def read_nvml(nvml: Any, numa_of: Callable[[str], int | None] = lambda _bus: None) -> list[Gpu]:
    """Every GPU NVML sees, with NVLink peers by UUID. `nvml.nvmlInit` must have succeeded.

    Peers are matched by the PCI bus id at the far end of each link. Links that end on a
    device that is not one of our GPUs are NVSwitch links: two GPUs that both reach the
    switch fabric are peers, with the smaller of their switch link counts (as `topo -m`).
    """
    gpus: list[Gpu] = []
    links: list[dict[str, int]] = []
    try:
        count = int(nvml.nvmlDeviceGetCount())
        for i in range(count):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            bus = _bus_id(nvml.nvmlDeviceGetPciInfo(h))
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
            gpus.append(
                Gpu(
                    index=i,
                    uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                    name=_text(nvml.nvmlDeviceGetName(h)),
                    memory_total=int(mem.total) // MIB,
                    memory_free=int(mem.free) // MIB,
                    pci_bus_id=bus,
                    numa_node=_numa(nvml, h, bus, numa_of),
                    compute_capability=f"{major}.{minor}",
                )
            )
            links.append(_nvlinks(nvml, h))
    except GpuOutputError:
        raise
    except Exception as exc:
        raise GpuOutputError(f"NVML: {exc}") from exc
    uuid_of = {g.pci_bus_id: g.uuid for g in gpus}
    switch = [sum(n for b, n in ls.items() if b not in uuid_of) for ls in links]
    out = []
    for k, g in enumerate(gpus):
        peers = {uuid_of[b]: n for b, n in links[k].items() if b in uuid_of and b != g.pci_bus_id}
        if switch[k]:
            for j, other in enumerate(gpus):
                if j != k and switch[j]:
                    peers[other.uuid] = peers.get(other.uuid, 0) + min(switch[k], switch[j])
        out.append(evolve(g, nvlink_peers=peers))
    return out

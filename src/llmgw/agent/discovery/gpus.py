"""Choose the GPU source (NVML, nvidia-smi, none) and read the GPUs. Blocking: to_thread.

Never raises for a missing or broken driver: zero GPUs and a warning instead, because a
node without GPUs is still a node, and a crash here would take the agent down with it.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from typing import Any

from attrs import evolve, field, frozen

from llmgw.agent.discovery.nvidia_smi import (
    LEGACY_QUERY_ARGS,
    QUERY_ARGS,
    TOPO_ARGS,
    GpuOutputError,
    apply_topology,
    parse_query_gpu,
    parse_topo,
    sysfs_bus_id,
)
from llmgw.agent.discovery.nvml import GpuReads, read_nvml
from llmgw.config.agent import DiscoveryConfig
from llmgw.model.inventory import Gpu, GpuSource

log = logging.getLogger(__name__)

PCI_ROOT = "/sys/bus/pci/devices"
NVIDIA_SMI_TIMEOUT = 30.0
# What a simulated GPU looks like (`discovery.simulated_gpus`, for trying llmgw without GPUs).
SIMULATED_NAME = "llmgw simulated GPU"
SIMULATED_MEMORY_MIB = 24 * 1024
SIMULATED_NVLINKS = 4


@frozen
class GpuReading:
    gpus: tuple[Gpu, ...] = ()
    source: GpuSource = GpuSource.NONE
    warnings: tuple[str, ...] = field(default=())


def numa_from_sysfs(bus_id: str, pci_root: str = PCI_ROOT) -> int | None:
    """NUMA node of a PCI device from sysfs; None when unknown (-1, absent, unreadable)."""
    try:
        path = os.path.join(pci_root, sysfs_bus_id(bus_id), "numa_node")
        with open(path) as f:
            node = int(f.read().strip())
    except (OSError, ValueError, GpuOutputError) as exc:
        log.debug("no NUMA node for %s: %s", bus_id, exc)
        return None
    return node if node >= 0 else None


def load_nvml() -> Any | None:
    """The real pynvml module, or None when nvidia-ml-py is not installed."""
    try:
        import pynvml
    except ImportError as exc:
        log.debug("pynvml not importable: %s", exc)
        return None
    return pynvml


def _ordered(gpus: list[Gpu]) -> tuple[Gpu, ...]:
    # A GPU whose bus id NVML could not read (lost) goes last, by its index.
    return tuple(sorted(gpus, key=lambda g: (not g.pci_bus_id, g.pci_bus_id, g.index)))


def _try_nvml(nvml: Any, pci_root: str, reads: GpuReads | None = None) -> tuple[list[Gpu] | None, str]:
    try:
        nvml.nvmlInit()
    except Exception as exc:
        return None, f"NVML did not load ({exc})"
    try:
        return read_nvml(nvml, lambda bus: numa_from_sysfs(bus, pci_root), reads=reads), ""
    except GpuOutputError as exc:
        return None, str(exc)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvmlShutdown: %s", exc)


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=NVIDIA_SMI_TIMEOUT,
        check=False,
        env={**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
    )


# Of a tool's stderr, a warning quotes the head only.
STDERR_MAX = 300


def _head(text: str) -> str:
    text = " ".join(text.strip().split())
    return text if len(text) <= STDERR_MAX else text[:STDERR_MAX] + "…"


def _failed(what: str, proc: subprocess.CompletedProcess[str]) -> str:
    err = _head(proc.stderr or proc.stdout or "")
    return f"{what} exited with status {proc.returncode}: {err or '(no output)'}"


def _read_nvidia_smi(exe: str, pci_root: str) -> tuple[list[Gpu] | None, list[str]]:
    """The GPUs of every good line nvidia-smi printed, and warnings; None: no GPU could be
    read (it failed, or printed nothing readable)."""
    warnings: list[str] = []
    try:
        proc = _run([exe, *QUERY_ARGS])
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, [f"{exe} could not be run: {exc}"]
    if proc.returncode != 0 and "compute_cap" in proc.stdout + proc.stderr:
        try:
            proc = _run([exe, *LEGACY_QUERY_ARGS])
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, [f"{exe} could not be run: {exc}"]
    reading = parse_query_gpu(proc.stdout)
    if proc.returncode != 0 and not reading.gpus:
        return None, [_failed(exe, proc)]
    if not reading.gpus and reading.warnings:
        stderr = _head(proc.stderr)
        return None, [f"{exe}: {w}" + (f"; stderr: {stderr}" if stderr else "") for w in reading.warnings]
    # Some GPUs read: keep them. nvidia-smi exits non-zero when it could not read one GPU
    # (lost, fallen off the bus) yet still prints the others.
    if proc.returncode != 0:
        warnings.append(_failed(exe, proc) + f"; kept the {len(reading.gpus)} GPU(s) it printed")
    warnings.extend(f"{exe}: {w}" for w in reading.warnings)
    gpus = list(reading.gpus)
    if len(gpus) > 0:
        try:
            topo_proc = _run([exe, *TOPO_ARGS])
            if topo_proc.returncode != 0:
                warnings.append(_failed(f"{exe} topo -m", topo_proc) + "; no NVLink peers")
            else:
                gpus = apply_topology(gpus, parse_topo(topo_proc.stdout))
        except (OSError, subprocess.TimeoutExpired, GpuOutputError) as exc:
            warnings.append(f"{exe} topo -m: {exc}; no NVLink peers")
    gpus = [
        g if g.numa_node is not None else evolve(g, numa_node=numa_from_sysfs(g.pci_bus_id, pci_root))
        for g in gpus
    ]
    return gpus, warnings


def simulated_gpus(node_id: str, count: int) -> tuple[Gpu, ...]:
    """`count` fake GPUs for `node_id`: 24 GiB each, NVLink between every pair."""
    uuids = [f"GPU-sim-{node_id}-{i}" for i in range(count)]
    return tuple(
        Gpu(
            index=i,
            uuid=uuid,
            name=SIMULATED_NAME,
            memory_total=SIMULATED_MEMORY_MIB,
            memory_free=SIMULATED_MEMORY_MIB,
            pci_bus_id=f"00000000:{i + 1:02X}:00.0",
            numa_node=0,
            compute_capability="9.0",
            nvlink_peers={peer: SIMULATED_NVLINKS for peer in uuids if peer != uuid},
        )
        for i, uuid in enumerate(uuids)
    )


# Node ids whose simulated GPUs were announced already: discovery reruns every minute,
# and the line is worth reading once.
_announced: set[str] = set()


def read_gpus(
    config: DiscoveryConfig,
    *,
    nvml: Any | None = None,
    search_path: str | None = None,
    pci_root: str = PCI_ROOT,
    node_id: str = "node",
    reads: GpuReads | None = None,
) -> GpuReading:
    """Read this node's GPUs, ordered by PCI bus id. `nvml` None: try the real pynvml.
    `reads`: what one NVML read hands the next (nvml.GpuReads); None: no history.

    Where no GPU source answers and `config.simulated_gpus` > 0, that many simulated GPUs
    stand in (for trying llmgw without GPUs)."""
    reading = _read_real(config, nvml=nvml, search_path=search_path, pci_root=pci_root, reads=reads)
    if reading.source is not GpuSource.NONE or config.simulated_gpus <= 0:
        return reading
    if node_id not in _announced:
        _announced.add(node_id)
        why = "; ".join(w.removeprefix("no GPUs found: ") for w in reading.warnings) or "no GPUs"
        log.info("no GPU source (%s): reporting %d simulated GPUs (discovery.simulated_gpus)",
                 why, config.simulated_gpus)
    return GpuReading(simulated_gpus(node_id, config.simulated_gpus), GpuSource.SIMULATED)


def _read_real(
    config: DiscoveryConfig,
    *,
    nvml: Any | None,
    search_path: str | None,
    pci_root: str,
    reads: GpuReads | None = None,
) -> GpuReading:
    if config.skip_gpus:
        return GpuReading(source=GpuSource.SKIPPED)
    notes: list[str] = []
    if config.prefer_nvml:
        module = nvml if nvml is not None else load_nvml()
        if module is None:
            notes.append("NVML not installed")
        else:
            gpus, why = _try_nvml(module, pci_root, reads)
            if gpus is not None:
                return GpuReading(_ordered(gpus), GpuSource.NVML)
            notes.append(why)
    exe = config.nvidia_smi or shutil.which("nvidia-smi", path=search_path)
    if not exe:
        why = "; ".join([*notes, "nvidia-smi not found on PATH"])
        return GpuReading(source=GpuSource.NONE, warnings=(f"no GPUs found: {why}",))
    if not os.access(exe, os.X_OK):
        why = "; ".join([*notes, f"nvidia-smi {exe} is missing or not executable"])
        return GpuReading(source=GpuSource.NONE, warnings=(f"no GPUs found: {why}",))
    found, warnings = _read_nvidia_smi(exe, pci_root)
    if found is None:
        return GpuReading(source=GpuSource.NONE, warnings=tuple(f"no GPUs found: {w}" for w in warnings))
    return GpuReading(_ordered(found), GpuSource.NVIDIA_SMI, tuple(warnings))

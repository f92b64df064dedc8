"""The trio shell around discovery: runs the slow parts in threads, gathers warnings.

Discovery never blocks the agent's heartbeats: NVML, nvidia-smi, sysfs and the model
walk all run in `trio.to_thread.run_sync`.
"""

from __future__ import annotations

import functools
import logging
import os
import sys

import trio
from attrs import evolve

from llmgw.agent.discovery.engine_check import check_engines
from llmgw.agent.discovery.gpus import PCI_ROOT, read_gpus
from llmgw.agent.discovery.infiniband import assess_fabrics, read_hcas
from llmgw.agent.discovery.mountinfo import Mount, parse_mountinfo
from llmgw.agent.discovery.nvml import GpuReads
from llmgw.agent.discovery.pcie import link_path, sysfs_name
from llmgw.agent.discovery.storage import scan_storage
from llmgw.agent.engines.weights import download_dir_of
from llmgw.config.agent import AgentConfig
from llmgw.model.inventory import Gpu, Inventory, StorageReport

log = logging.getLogger(__name__)

MOUNTINFO = "/proc/self/mountinfo"
# Free memory moves with every engine; smaller moves than this are not a change.
FREE_MEMORY_SLACK_MIB = 1024
# download_dir's free space moves with every download and log; smaller moves than this
# are not a change (placement refuses a node short by the size of a model, tens of GB).
FREE_SPACE_SLACK = 4 * 2**30


def _with_pci_paths(gpus: tuple[Gpu, ...], pci_root: str) -> tuple[Gpu, ...]:
    """Each GPU's PCIe ancestry from sysfs (`pci_root` is /sys/bus/pci/devices), for
    placement's same-switch preference on nodes without NVLink; () where unknown."""
    out = []
    for g in gpus:
        name = sysfs_name(g.pci_bus_id)
        path = link_path(os.path.join(pci_root, name)) if name else ()
        out.append(evolve(g, pci_path=path) if path and path[-1] == name else g)
    return tuple(out)


def _read_mounts(path: str) -> list[Mount]:
    try:
        with open(path) as f:
            return parse_mountinfo(f.read())
    except OSError as exc:
        log.warning("cannot read %s (%s); all model_dirs taken as local", path, exc)
        return []


async def discover(
    config: AgentConfig,
    *,
    nvml: object | None = None,
    mountinfo_path: str = MOUNTINFO,
    pci_root: str = PCI_ROOT,
    search_path: str | None = None,
    logged: set[str] | None = None,
    python: str = sys.executable,
    gpu_reads: GpuReads | None = None,
) -> Inventory:
    """What this node has. Raises DiscoveryError when it contradicts the config.

    `nvml`: a pynvml-like object (None: the real pynvml when installed). `logged`: the
    warnings already logged by earlier runs, so a periodic rerun does not repeat them.
    `python`: the interpreter of the simulated engine where `engines.simulated_python`
    is unset (the agent's own). `gpu_reads`: what NVML reads carry from one to the next
    (an NVML read error is a problem only after several in a row; None: at once).
    """
    disc = config.discovery
    gpu_reading = await trio.to_thread.run_sync(
        functools.partial(read_gpus, disc, nvml=nvml, search_path=search_path, pci_root=pci_root,
                          node_id=config.node_id, reads=gpu_reads)
    )
    gpus = await trio.to_thread.run_sync(_with_pci_paths, gpu_reading.gpus, pci_root)
    hcas = await trio.to_thread.run_sync(read_hcas, disc.ib_root)
    fabrics = assess_fabrics(hcas, config.fabrics, source=config.source)
    download_dir = download_dir_of(config)
    if config.model_dirs is not None:
        mounts = await trio.to_thread.run_sync(_read_mounts, mountinfo_path)
        storage = await trio.to_thread.run_sync(scan_storage, config.model_dirs, mounts,
                                                download_dir)
    else:
        storage = await trio.to_thread.run_sync(scan_storage, None, [], download_dir)
    engines = await trio.to_thread.run_sync(
        functools.partial(check_engines, config, python=python))
    warnings = tuple(dict.fromkeys((*gpu_reading.warnings, *fabrics.warnings, *storage.warnings)))
    seen = logged if logged is not None else set()
    for w in warnings:
        if w not in seen:
            log.warning("discovery: %s", w)
            seen.add(w)
    return Inventory(
        gpus=gpus,
        gpu_source=gpu_reading.source,
        hcas=hcas,
        fabrics=fabrics.fabrics,
        unlabelled_hcas=fabrics.unlabelled_hcas,
        storage=storage.report,
        warnings=warnings,
        engines=engines,
    )


def _pids(g: Gpu) -> frozenset[int]:
    return frozenset(p.pid for p in g.processes)


def _gpu_same(a: Gpu, b: Gpu) -> bool:
    """Same GPU for the server's purposes. Problems (lost, MIG, ECC, Xid...) and
    `releasing` always count: they decide whether it may be placed. Processes count by
    who is there (their pids), not by the memory each holds, which moves with every
    batch: the memory shows in memory_free, under its slack."""
    if abs(a.memory_free - b.memory_free) > FREE_MEMORY_SLACK_MIB:
        return False
    if a.problems != b.problems or a.releasing != b.releasing or _pids(a) != _pids(b):
        return False
    return evolve(a, memory_free=b.memory_free, processes=b.processes) == b


def _space_slack(old: StorageReport, new: StorageReport) -> StorageReport:
    """`old`, with new's free space and downloads' bytes where each moved by less than
    FREE_SPACE_SLACK (the same downloads: one that begins or ends is a change). A download
    moves both together, so they are reported together: placement adds them up."""
    known = old.download_free >= 0 and new.download_free >= 0
    if known and abs(old.download_free - new.download_free) < FREE_SPACE_SLACK:
        old = evolve(old, download_free=new.download_free)
    if old.downloading.keys() == new.downloading.keys() and all(
            abs(n - old.downloading[m]) < FREE_SPACE_SLACK for m, n in new.downloading.items()):
        old = evolve(old, downloading=new.downloading)
    return old


def inventory_changed(old: Inventory | None, new: Inventory) -> bool:
    """Whether `new` is worth reporting after `old`. Free GPU memory drifting by less
    than FREE_MEMORY_SLACK_MIB, or a process's memory or command line changing, is not a
    change; anything else is (a GPU's problems, its process pids, `releasing`)."""
    if old is None:
        return True
    if len(old.gpus) != len(new.gpus):
        return True
    if not all(_gpu_same(a, b) for a, b in zip(old.gpus, new.gpus, strict=True)):
        return True
    return (
        old.gpu_source,
        old.hcas,
        old.fabrics,
        old.unlabelled_hcas,
        _space_slack(old.storage, new.storage),
        old.warnings,
        old.engines,
    ) != (
        new.gpu_source,
        new.hcas,
        new.fabrics,
        new.unlabelled_hcas,
        new.storage,
        new.warnings,
        new.engines,
    )

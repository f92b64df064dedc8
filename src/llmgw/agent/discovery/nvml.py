"""Read GPUs through NVML, over an injected pynvml-like object (the real one: `pynvml`).

Blocking: run it in `trio.to_thread`. The caller decides what to do when NVML is absent.

Each GPU is read on its own: one that NVML cannot read (lost, fallen off the bus, an
error on one field) is reported with its problems and what could be read, and the others
still count. Only nvmlDeviceGetCount failing means NVML gives nothing.

A read error on one field is a problem only once READ_ERRORS_IN_A_ROW reads of it failed
in a row (gpu_health.next_streak), where the caller keeps a `GpuReads` from one read to
the next (the agent does); meanwhile what that field said last time stands in for it. A
caller without one (a one-shot check) sees every error at once. GPU_IS_LOST counts at once
either way: the driver has given the GPU up.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from attrs import evolve

from llmgw.agent.discovery.gpu_health import (
    READ_ERRORS_IN_A_ROW,
    FabricReading,
    HealthReading,
    ReadStreak,
    classify,
    next_streak,
)
from llmgw.agent.discovery.nvidia_smi import GpuOutputError, normalise_bus_id
from llmgw.agent.gpus.memory import GpuMemory
from llmgw.model.inventory import Gpu, GpuProcess

log = logging.getLogger(__name__)

MIB = 1024 * 1024
# When the module does not say NVML_NVLINK_MAX_LINKS; links past the GPU's last raise.
MAX_LINKS = 18
# pynvml's codes, for modules (fakes, old versions) that do not name them.
ERROR_NOT_SUPPORTED = 3
ERROR_FUNCTION_NOT_FOUND = 13
ERROR_GPU_IS_LOST = 15
NVML_SUCCESS = 0
# pynvml's NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, for modules that do not name it.
FI_DEV_GET_GPU_RECOVERY_ACTION = 230
MEMORY_ERROR_TYPE_UNCORRECTED = 1
VOLATILE_ECC = 0
# A command line is shown shortened: enough to tell `python train.py` from a notebook.
COMMAND_MAX = 80
# More processes than this on one GPU (MPS clients) are not worth a bigger inventory.
MAX_PROCESSES = 32

CmdlineReader = Callable[[int], str]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bus_id(pci: Any) -> str:
    raw = getattr(pci, "busId", None) or getattr(pci, "busIdLegacy", "")
    return normalise_bus_id(_text(raw))


def _code(nvml: Any, exc: BaseException, name: str, default: int) -> bool:
    return getattr(exc, "value", None) == getattr(nvml, name, default)


def _not_applicable(nvml: Any, exc: BaseException) -> bool:
    """Not Supported here (or the function is not in this driver or binding): the
    question does not apply to this GPU, which is never a problem."""
    return (
        isinstance(exc, AttributeError)
        or _code(nvml, exc, "NVML_ERROR_NOT_SUPPORTED", ERROR_NOT_SUPPORTED)
        or _code(nvml, exc, "NVML_ERROR_FUNCTION_NOT_FOUND", ERROR_FUNCTION_NOT_FOUND)
    )


def _lost(nvml: Any, exc: BaseException) -> bool:
    return _code(nvml, exc, "NVML_ERROR_GPU_IS_LOST", ERROR_GPU_IS_LOST)


def shorten_command(raw: bytes | str, limit: int = COMMAND_MAX) -> str:
    """A /proc/<pid>/cmdline (NUL-separated) as one line of at most `limit` characters."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    line = " ".join(part for part in text.replace("\0", " ").split() if part)
    line = "".join(c if c.isprintable() else "?" for c in line)
    return line if len(line) <= limit else line[: limit - 1] + "…"


def proc_cmdline(pid: int, proc_root: str = "/proc") -> str:
    """The shortened command line of `pid`; "" where /proc does not say (gone, another
    PID namespace, hidepid)."""
    try:
        with open(os.path.join(proc_root, str(pid), "cmdline"), "rb") as f:
            return shorten_command(f.read(4096))
    except OSError as exc:
        log.debug("no command line for pid %d: %s", pid, exc)
        return ""


class GpuReads:
    """What one read of this node's GPUs hands the next: per NVML index, each field's
    read errors in a row and the GPU's last record; per UUID, its last health reading
    (the Xid watch's reset check reads them). Discovery and the check before a spawn
    share one, from their threads: a lock around the little each does."""

    def __init__(self, limit: int = READ_ERRORS_IN_A_ROW) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._streaks: dict[int, ReadStreak] = {}
        self._last: dict[int, Gpu] = {}
        self._health: dict[str, HealthReading] = {}

    def after(self, index: int, errors: dict[str, str]) -> tuple[str, ...]:
        """The problems of GPU `index`'s read errors this time (next_streak)."""
        with self._lock:
            state, problems = next_streak(self._streaks.get(index, ReadStreak()), errors, limit=self.limit)
            self._streaks[index] = state
        for what, why in errors.items():
            if not problems:
                # Bounded: one line per field per read, at most a field count per GPU.
                log.info("GPU %d: NVML error reading %s (%d in a row; a problem at %d): %s",
                         index, what, state.counts[what], self.limit, why)
        return problems

    def last(self, index: int) -> Gpu | None:
        with self._lock:
            return self._last.get(index)

    def keep(self, gpu: Gpu, health: HealthReading) -> None:
        with self._lock:
            self._last[gpu.index] = gpu
            self._health[gpu.uuid] = health

    def health(self) -> dict[str, HealthReading]:
        """The last health reading of each GPU, by UUID."""
        with self._lock:
            return dict(self._health)


class _Reader:
    """Calls NVML for one GPU, keeping each failure as a read error of its field.

    After a lost-GPU error nothing more is asked of that GPU: every call would fail the
    same way, and some take seconds each on a GPU that has fallen off the bus."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.problems: list[str] = []  # lost: counts at once
        self.errors: dict[str, str] = {}  # field -> NVML's words: counted in a streak
        self.lost = False

    def get(self, what: str, call: Callable[[], Any], default: Any) -> Any:
        if self.lost:
            return default
        try:
            return call()
        except Exception as exc:  # NVMLError, or a value NVML handed back that does not parse
            self._failed(what, exc)
            return default

    def optional(self, what: str, call: Callable[[], Any]) -> Any:
        """A health field: None where Not Supported, else as `get`."""
        if self.lost:
            return None
        try:
            return call()
        except Exception as exc:
            if _not_applicable(self.nvml, exc):
                log.debug("NVML %s: not applicable (%s)", what, exc)
            else:
                self._failed(what, exc)
            return None

    def _failed(self, what: str, exc: BaseException) -> None:
        log.debug("NVML %s: %s", what, exc)
        if _lost(self.nvml, exc):
            self.lost = True
            self.problems.append(f"lost: {exc}")
        else:
            self.errors[what] = str(exc)


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
    return numa_of(bus) if bus else None


def _fabric(nvml: Any, handle: Any) -> FabricReading:
    info = nvml.c_nvmlGpuFabricInfo_t()
    nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
    state, status = int(info.state), int(info.status)
    text = ""
    if status:
        try:
            text = str(nvml.NVMLError(status))
        except Exception as exc:
            log.debug("no text for NVML status %d: %s", status, exc)
    return FabricReading(state, status, text)


def _recovery_action(nvml: Any, handle: Any) -> int:
    """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (nvmlDeviceGpuRecoveryAction_t). A field value
    carries its own return code: Not Supported there (drivers before R550) is raised as
    NVML would, so that it reads as not applicable."""
    fid = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", FI_DEV_GET_GPU_RECOVERY_ACTION)
    value = nvml.nvmlDeviceGetFieldValues(handle, [fid])[0]
    ret = int(value.nvmlReturn)
    if ret != getattr(nvml, "NVML_SUCCESS", NVML_SUCCESS):
        raise nvml.NVMLError(ret)
    return int(value.value.uiVal)


def read_health(nvml: Any, handle: Any, r: _Reader) -> HealthReading:
    ecc_type = getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", MEMORY_ERROR_TYPE_UNCORRECTED)
    volatile = getattr(nvml, "NVML_VOLATILE_ECC", VOLATILE_ECC)
    mig = r.optional("MIG mode", lambda: nvml.nvmlDeviceGetMigMode(handle))
    rows = r.optional("remapped rows", lambda: nvml.nvmlDeviceGetRemappedRows(handle))
    return HealthReading(
        mig_current=int(mig[0]) if mig is not None else None,
        ecc_uncorrected_volatile=r.optional(
            "ECC errors", lambda: int(nvml.nvmlDeviceGetTotalEccErrors(handle, ecc_type, volatile))),
        remapped_rows=tuple(int(x) for x in rows[:4]) if rows is not None else None,  # type: ignore[arg-type]
        retired_pages_pending=r.optional(
            "retired pages", lambda: int(nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))),
        fabric=r.optional("NVSwitch fabric", lambda: _fabric(nvml, handle)),
        recovery_action=r.optional("recovery action", lambda: _recovery_action(nvml, handle)),
    )


def _process_name(nvml: Any, pid: int) -> str:
    try:
        return shorten_command(_text(nvml.nvmlSystemGetProcessName(pid)))
    except Exception as exc:
        log.debug("nvmlSystemGetProcessName(%d): %s", pid, exc)
        return ""


def read_processes(nvml: Any, handle: Any, cmdline_of: CmdlineReader) -> tuple[GpuProcess, ...]:
    """Every compute process on the GPU, largest first. Raises what NVML raises."""
    held: dict[int, int] = {}
    for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
        used = getattr(p, "usedGpuMemory", None)  # None: NVML does not say (MIG, permission)
        pid = int(p.pid)
        held[pid] = held.get(pid, 0) + (int(used) // MIB if used is not None else 0)
    top = sorted(held.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_PROCESSES]
    return tuple(GpuProcess(pid, cmdline_of(pid) or _process_name(nvml, pid), mib) for pid, mib in top)


def _unreadable(index: int, exc: BaseException, lost: bool) -> Gpu:
    uuid = f"unknown-{index}"
    why = f"lost: {exc}" if lost else f"NVML error reading the handle: {exc}"
    return Gpu(index=index, uuid=uuid, name="", memory_total=0, memory_free=0, pci_bus_id="",
               problems=(why, f"UUID unknown (NVML gave no handle): listed as {uuid}"))


def _streak(reads: GpuReads | None, i: int, errors: dict[str, str]) -> tuple[str, ...]:
    if reads is None:  # no history: every error counts now
        return next_streak(ReadStreak(), errors, limit=1)[1]
    return reads.after(i, errors)


def _no_handle(nvml: Any, i: int, exc: BaseException, reads: GpuReads | None) -> Gpu:
    last = reads.last(i) if reads is not None else None
    if _lost(nvml, exc):
        problems: tuple[str, ...] = (f"lost: {exc}",)
    else:
        problems = _streak(reads, i, {"the handle": str(exc)})
        if not problems and last is not None:
            return last  # a passing error: the GPU as it was last read
    if last is None:
        return _unreadable(i, exc, _lost(nvml, exc))
    # Its identity as last read, so that what runs on it is moved off the right GPU.
    gpu = evolve(last, problems=problems, processes=())
    if reads is not None:
        reads.keep(gpu, HealthReading(lost=_lost(nvml, exc)))
    return gpu


def _read_one(
    nvml: Any, i: int, numa_of: Callable[[str], int | None], cmdline_of: CmdlineReader, *, links: bool,
    reads: GpuReads | None = None,
) -> tuple[Gpu, dict[str, int]]:
    try:
        h = nvml.nvmlDeviceGetHandleByIndex(i)
    except Exception as exc:
        log.debug("NVML GPU %d: no handle: %s", i, exc)
        return _no_handle(nvml, i, exc, reads), {}
    r = _Reader(nvml)
    bus = r.get("PCI bus id", lambda: _bus_id(nvml.nvmlDeviceGetPciInfo(h)), "")
    uuid = r.get("UUID", lambda: _text(nvml.nvmlDeviceGetUUID(h)), "")
    name = r.get("name", lambda: _text(nvml.nvmlDeviceGetName(h)), "")
    mem = r.get("memory", lambda: nvml.nvmlDeviceGetMemoryInfo(h), None)
    cap = r.get("compute capability", lambda: "{}.{}".format(*nvml.nvmlDeviceGetCudaComputeCapability(h)), "")
    numa = None if r.lost else _numa(nvml, h, bus, numa_of)
    health = read_health(nvml, h, r)
    procs = r.get("processes", lambda: read_processes(nvml, h, cmdline_of), ())
    health = evolve(health, lost=r.lost)
    problems = [*r.problems, *_streak(reads, i, r.errors)]
    gpu = Gpu(
        index=i,
        uuid=uuid,
        name=name,
        memory_total=int(mem.total) // MIB if mem is not None else 0,
        memory_free=int(mem.free) // MIB if mem is not None else 0,
        pci_bus_id=bus,
        numa_node=numa,
        compute_capability=cap,
        processes=procs,
    )
    last = reads.last(i) if reads is not None else None
    if last is not None:
        gpu = _as_last(gpu, last, r.errors)
    if not gpu.uuid:
        uuid = f"unknown-{gpu.pci_bus_id or i}"
        gpu = evolve(gpu, uuid=uuid)
        problems.append(f"UUID unknown (NVML could not read it): listed as {uuid}")
    problems.extend(classify(health).lines)
    gpu = evolve(gpu, problems=tuple(dict.fromkeys(problems)))
    if reads is not None and not gpu.uuid.startswith("unknown-"):
        reads.keep(gpu, health)
    return gpu, (_nvlinks(nvml, h) if links and not r.lost else {})


def _as_last(gpu: Gpu, last: Gpu, errors: dict[str, str]) -> Gpu:
    """`gpu` with what the fields that failed this time said last time: one passing
    error must not rename the GPU (a new UUID is a new GPU to the server), zero its
    memory or forget what holds it."""
    if not errors:
        return gpu
    return evolve(
        gpu,
        uuid=gpu.uuid or last.uuid,
        pci_bus_id=gpu.pci_bus_id or last.pci_bus_id,
        name=gpu.name or last.name,
        memory_total=last.memory_total if "memory" in errors else gpu.memory_total,
        memory_free=last.memory_free if "memory" in errors else gpu.memory_free,
        compute_capability=gpu.compute_capability or last.compute_capability,
        processes=last.processes if "processes" in errors else gpu.processes,
    )


def _count(nvml: Any) -> int:
    try:
        return int(nvml.nvmlDeviceGetCount())
    except Exception as exc:
        raise GpuOutputError(f"NVML: {exc}") from exc


def read_nvml(
    nvml: Any,
    numa_of: Callable[[str], int | None] = lambda _bus: None,
    cmdline_of: CmdlineReader = proc_cmdline,
    reads: GpuReads | None = None,
) -> list[Gpu]:
    """Every GPU NVML sees, with NVLink peers by UUID, health problems and compute
    processes. `nvml.nvmlInit` must have succeeded. Raises GpuOutputError only when NVML
    cannot count the GPUs; a GPU it cannot read is listed with its problems.

    Peers are matched by the PCI bus id at the far end of each link. Links that end on a
    device that is not one of our GPUs are NVSwitch links: two GPUs that both reach the
    switch fabric are peers, with the smaller of their switch link counts (as `topo -m`).
    """
    gpus: list[Gpu] = []
    links: list[dict[str, int]] = []
    for i in range(_count(nvml)):
        gpu, ls = _read_one(nvml, i, numa_of, cmdline_of, links=True, reads=reads)
        gpus.append(gpu)
        links.append(ls)
    uuid_of = {g.pci_bus_id: g.uuid for g in gpus if g.pci_bus_id}
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


def read_gpu_memory(
    nvml: Any, cmdline_of: CmdlineReader = proc_cmdline, reads: GpuReads | None = None
) -> dict[str, GpuMemory] | None:
    """Per GPU UUID: NVML's index, total and free MiB, every compute process, problems
    (health included). Opens its own NVML session (nvmlInit is reference-counted, so a
    session held by the metrics stays open). None when NVML does not answer at all; one
    GPU's error does not lose the others. Blocking: the supervisor runs it in a thread.

    A `GpuMemoryReader` is `functools.partial(read_gpu_memory, nvml)`."""
    try:
        nvml.nvmlInit()
    except Exception as exc:
        log.info("GPU memory: NVML did not load (%s)", exc)
        return None
    try:
        count = _count(nvml)
        out: dict[str, GpuMemory] = {}
        for i in range(count):
            g, _ = _read_one(nvml, i, lambda _bus: None, cmdline_of, links=False, reads=reads)
            out[g.uuid] = GpuMemory(g.uuid, g.index, g.memory_total, g.memory_free, g.processes,
                                    g.problems)
        return out
    except GpuOutputError as exc:
        log.info("GPU memory: %s", exc)
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvmlShutdown: %s", exc)

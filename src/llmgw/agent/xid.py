"""Watch NVML's Xid critical-error events and mark the GPUs they make unhealthy.

NVML's event set is waited on in a thread (`nvmlEventSetWait_v2` blocks up to WAIT_MS);
the trio task around it turns each Xid into a problem line through the pure table below
and hands it to `on_problem(uuid, problem)`. `XidProblems` keeps them until the agent
restarts: a GPU that has reported Xid 79 or 48 needs a reset, which restarts the driver
and with it this agent's view, so there is nothing to clear them on before that.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import trio
from attrs import evolve

from llmgw.agent.gpu_memory import GpuMemory
from llmgw.model.inventory import Inventory

log = logging.getLogger(__name__)

# How long one wait in the thread lasts: also how long a cancelled watch takes to stop
# (the wait is not abandoned, so that the event set is never freed under it).
WAIT_MS = 500
# After an error other than a timeout, wait this long before waiting again.
ERROR_BACKOFF = 5.0
XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError, where the module does not name it
ERROR_TIMEOUT = 10
ERROR_NOT_SUPPORTED = 3
ERROR_FUNCTION_NOT_FOUND = 13

# The Xids after which a GPU must not be given new work until it is reset, with the
# names NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors) gives them. Each is a
# fault of the GPU, its memory, NVLink or its firmware: the catalog's action for all of
# them is a GPU reset or a node reboot (63/64/94: the remap or retirement takes effect
# on reset; 95/140: memory contents can no longer be trusted).
#
# Left out on purpose: application faults, which the process that caused them pays for
# and which leave the GPU usable: 13 "Graphics Engine Exception", 31 "GPU memory page
# fault", 43 "GPU stopped processing", 45 "Preemptive cleanup, due to previous errors".
# An engine that hits one of these crashes and is restarted by the supervisor.
UNHEALTHY_XIDS: dict[int, str] = {
    48: "double bit ECC error",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}


def xid_problem(xid: int, at: datetime) -> str | None:
    """The problem line for Xid `xid` seen at `at`; None: it leaves the GPU usable."""
    what = UNHEALTHY_XIDS.get(xid)
    if what is None:
        return None
    return f"Xid {xid} at {at.astimezone(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')}: {what}"


class XidProblems:
    """GPU UUID -> the Xid problems seen since the agent started, at most MAX_PER_GPU
    each (the first ones: they say what happened; later ones add nothing to "reset it").

    No I/O: `add` is the watcher's on_problem; `apply` puts them into every inventory the
    agent reports, `apply_memory` into what the supervisor reads before a spawn."""

    MAX_PER_GPU = 4

    def __init__(self) -> None:
        self._by_uuid: dict[str, tuple[str, ...]] = {}

    def add(self, uuid: str, problem: str) -> bool:
        """Keep `problem` for `uuid`; False when it was there already or the GPU is full."""
        have = self._by_uuid.get(uuid, ())
        if problem in have or len(have) >= self.MAX_PER_GPU:
            return False
        self._by_uuid[uuid] = (*have, problem)
        return True

    def of(self, uuid: str) -> tuple[str, ...]:
        return self._by_uuid.get(uuid, ())

    def __bool__(self) -> bool:
        return bool(self._by_uuid)

    def _merged(self, uuid: str, problems: tuple[str, ...]) -> tuple[str, ...]:
        return (*problems, *(p for p in self.of(uuid) if p not in problems))

    def apply(self, inventory: Inventory) -> Inventory:
        """`inventory` with each GPU's Xid problems added to its own (the same object
        when there is nothing to add)."""
        if not any(g.uuid in self._by_uuid for g in inventory.gpus):
            return inventory
        gpus = tuple(evolve(g, problems=self._merged(g.uuid, g.problems)) if g.uuid in self._by_uuid else g
                     for g in inventory.gpus)
        return evolve(inventory, gpus=gpus)

    def apply_memory(self, memory: Mapping[str, GpuMemory]) -> dict[str, GpuMemory]:
        return {u: evolve(m, problems=self._merged(u, m.problems)) if u in self._by_uuid else m
                for u, m in memory.items()}


def _code(nvml: Any, exc: BaseException, name: str, default: int) -> bool:
    return getattr(exc, "value", None) == getattr(nvml, name, default)


def _unsupported(nvml: Any, exc: BaseException) -> bool:
    return (isinstance(exc, AttributeError)
            or _code(nvml, exc, "NVML_ERROR_NOT_SUPPORTED", ERROR_NOT_SUPPORTED)
            or _code(nvml, exc, "NVML_ERROR_FUNCTION_NOT_FOUND", ERROR_FUNCTION_NOT_FOUND))


def _key(handle: Any) -> Any:
    """A hashable identity for an NVML device handle (a ctypes pointer, whose equality is
    by object, not address; the fakes use ints)."""
    if isinstance(handle, int):
        return handle
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


class _Watch:
    """An NVML session with an event set for Xid critical errors on every GPU that
    supports it. Blocking methods: call them in a thread."""

    def __init__(self, nvml: Any, event_set: Any, uuids: dict[Any, str]) -> None:
        self.nvml = nvml
        self.event_set = event_set
        self.uuids = uuids

    @classmethod
    def open(cls, nvml: Any) -> _Watch | None:
        try:
            nvml.nvmlInit()
        except Exception as exc:
            log.info("Xid watch: NVML did not load (%s); no Xid watch", exc)
            return None
        xid = getattr(nvml, "nvmlEventTypeXidCriticalError", XID_CRITICAL)
        event_set = None
        try:
            event_set = nvml.nvmlEventSetCreate()
            uuids: dict[Any, str] = {}
            for i in range(int(nvml.nvmlDeviceGetCount())):
                try:
                    h = nvml.nvmlDeviceGetHandleByIndex(i)
                    uuid = str(nvml.nvmlDeviceGetUUID(h))
                    nvml.nvmlDeviceRegisterEvents(h, xid, event_set)
                except Exception as exc:  # this GPU only: lost, or no events on this board
                    level = logging.DEBUG if _unsupported(nvml, exc) else logging.WARNING
                    log.log(level, "Xid watch: GPU %d not watched (%s)", i, exc)
                    continue
                uuids[_key(h)] = uuid
            if not uuids:
                raise LookupError("no GPU supports Xid events")
        except Exception as exc:
            # One line per agent run: this holds for the life of the driver.
            log.info("Xid watch: NVML events not available (%s); Xid errors are not watched", exc)
            cls._close(nvml, event_set)
            return None
        log.info("Xid watch: watching %d GPU(s)", len(uuids))
        return cls(nvml, event_set, uuids)

    def wait(self) -> tuple[str, int] | None:
        """(GPU UUID, Xid) of the next Xid event; None when WAIT_MS passed without one.
        Raises what NVML raises otherwise."""
        try:
            data = self.nvml.nvmlEventSetWait_v2(self.event_set, WAIT_MS)
        except Exception as exc:
            if _code(self.nvml, exc, "NVML_ERROR_TIMEOUT", ERROR_TIMEOUT):
                return None
            raise
        xid_type = getattr(self.nvml, "nvmlEventTypeXidCriticalError", XID_CRITICAL)
        if not int(getattr(data, "eventType", xid_type)) & xid_type:
            return None
        uuid = self.uuids.get(_key(data.device))
        if uuid is None:
            try:
                uuid = str(self.nvml.nvmlDeviceGetUUID(data.device))
            except Exception as exc:
                log.debug("Xid event for an unknown handle: %s", exc)
                uuid = "unknown"
        return uuid, int(data.eventData)

    def close(self) -> None:
        self._close(self.nvml, self.event_set)

    @staticmethod
    def _close(nvml: Any, event_set: Any) -> None:
        if event_set is not None:
            try:
                nvml.nvmlEventSetFree(event_set)
            except Exception as exc:
                log.debug("nvmlEventSetFree: %s", exc)
        try:
            nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvmlShutdown: %s", exc)


def _utcnow() -> datetime:
    return datetime.now(UTC)


async def serve_xid_watch(
    nvml: Any | None,
    on_problem: Callable[[str, str], None],
    *,
    now: Callable[[], datetime] = _utcnow,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Call `on_problem(uuid, "Xid 79 at <UTC time>: GPU has fallen off the bus")` once per
    GPU and unhealthy Xid, from this task (no locking needed), until cancelled. Returns at
    once, after one log line, where NVML or its event API is not there. `now`: the clock
    the problem lines are stamped with."""
    watch = await trio.to_thread.run_sync(_Watch.open, nvml) if nvml is not None else None
    task_status.started()
    if watch is None:
        return
    reported: set[tuple[str, int]] = set()
    last_error = ""
    try:
        while True:
            try:
                event = await trio.to_thread.run_sync(watch.wait)
            except Exception as exc:  # a lost GPU can fail the wait: keep watching the others
                if str(exc) != last_error:
                    log.warning("Xid watch: waiting for NVML events failed (%s); retrying every %.0f s",
                                exc, ERROR_BACKOFF)
                    last_error = str(exc)
                await trio.sleep(ERROR_BACKOFF)
                continue
            if event is None:
                continue
            uuid, xid = event
            problem = xid_problem(xid, now())
            if problem is None:
                log.info("GPU %s: Xid %d (an application fault; the GPU stays in use)", uuid, xid)
                continue
            if (uuid, xid) in reported:
                continue
            reported.add((uuid, xid))
            log.warning("GPU %s: %s; it is not placed again until it is reset", uuid, problem)
            on_problem(uuid, problem)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(watch.close)

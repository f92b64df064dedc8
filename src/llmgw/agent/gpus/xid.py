"""Watch NVML's Xid critical-error events and mark the GPUs they make unhealthy.

NVML's event set is waited on in a thread (`nvmlEventSetWait_v2` blocks up to WAIT_MS);
the trio task around it turns each Xid into a problem line through the pure table below
and hands it to `on_problem(uuid, problem)`. An event whose device cannot be told (a
handle not registered, whose UUID NVML will not give) calls `on_unresolved(xid)`: the
agent re-reads every GPU at once, since which one it was is not known.

`XidProblems` keeps them until the GPU was reset (a reading after the Xid shows it,
gpu_health.next_reset_watch) or the operator clears them (`llmgw ctl gpu clear NODE GPU`,
which reaches the agent as a ClearGpu message).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import trio
from attrs import evolve

from llmgw.agent.discovery.gpu_health import HealthReading, ResetWatch, next_reset_watch
from llmgw.agent.gpus.memory import GpuMemory
from llmgw.model.inventory import Inventory, soft

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
# Of those, the ones that only keep new work off (soft): 63 is the driver noting a row
# remap or page retirement it applies at the next reset ("reset gpu to activate"), the
# pending flag's own event, and a pending remap does not affect work on the GPU (NVML's
# nvmlDeviceGetRemappedRows); 94 is an ECC error the driver contained to the process that
# hit it (that engine exits and is restarted; the others on the GPU run on). Whether a
# reset is due now is NVML's recovery action's to say, which is hard.
SOFT_XIDS = frozenset({63, 94})


def xid_problem(xid: int, at: datetime) -> str | None:
    """The problem line for Xid `xid` seen at `at` (marked soft for SOFT_XIDS); None: it
    leaves the GPU usable."""
    what = UNHEALTHY_XIDS.get(xid)
    if what is None:
        return None
    line = f"Xid {xid} at {at.astimezone(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')}: {what}"
    return soft(line) if xid in SOFT_XIDS else line


def _xid_of(problem: str) -> str:
    """"Xid 79" of "Xid 79 at ...: ...", soft mark or not: one line per Xid number."""
    return problem.split(" at ", 1)[0]


class XidProblems:
    """GPU UUID -> the Xid problems seen since it was last reset or cleared, one per Xid
    number, at most MAX_PER_GPU each (the first ones: they say what happened; later ones
    add nothing to "reset it").

    No I/O: `add` is the watcher's on_problem; `observe` takes each GPU's latest health
    reading and drops a GPU's Xids once the readings show it was reset; `clear` is the
    operator's command; `apply` puts them into every inventory the agent reports,
    `apply_memory` into what the supervisor reads before a spawn."""

    MAX_PER_GPU = 4

    def __init__(self) -> None:
        self._by_uuid: dict[str, tuple[str, ...]] = {}
        self._watch: dict[str, ResetWatch] = {}

    def add(self, uuid: str, problem: str) -> bool:
        """Keep `problem` for `uuid`; False when its Xid is there already or the GPU is full."""
        have = self._by_uuid.get(uuid, ())
        if _xid_of(problem) in {_xid_of(p) for p in have} or len(have) >= self.MAX_PER_GPU:
            return False
        self._by_uuid[uuid] = (*have, problem)
        # The reset that clears it must come after this Xid: what was seen before does
        # not count (a flag still set is seen again at the next reading).
        self._watch[uuid] = ResetWatch()
        return True

    def of(self, uuid: str) -> tuple[str, ...]:
        return self._by_uuid.get(uuid, ())

    def clear(self, uuid: str) -> tuple[str, ...]:
        """Forget `uuid`'s Xid problems (the operator says it was dealt with); what was
        forgotten."""
        self._watch.pop(uuid, None)
        return self._by_uuid.pop(uuid, ())

    def observe(self, health: Mapping[str, HealthReading]) -> tuple[str, ...]:
        """Take each GPU's latest reading; the UUIDs whose Xid problems it cleared, as
        their readings show a reset since the Xid (gpu_health.ResetWatch)."""
        cleared = []
        for uuid in list(self._by_uuid):
            reading = health.get(uuid)
            if reading is None:
                continue
            watch, was_reset = next_reset_watch(self._watch.get(uuid, ResetWatch()), reading)
            if was_reset:
                self.clear(uuid)
                cleared.append(uuid)
            else:
                self._watch[uuid] = watch
        return tuple(cleared)

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

    def wait(self) -> tuple[str | None, int] | None:
        """(GPU UUID, Xid) of the next Xid event, the UUID None where the event's device
        cannot be told; None when WAIT_MS passed without one. Raises what NVML raises
        otherwise."""
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
    on_problem: Callable[[str, str], object],
    *,
    on_unresolved: Callable[[int], None] = lambda xid: None,
    now: Callable[[], datetime] = _utcnow,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Call `on_problem(uuid, "Xid 79 at <UTC time>: GPU has fallen off the bus")` for each
    unhealthy Xid event, from this task (no locking needed), until cancelled; it returns
    False when that GPU has that Xid already (XidProblems.add), which then is not logged
    again. An event whose device cannot be resolved calls `on_unresolved(xid)` instead of
    being dropped. Returns at once, after one log line, where NVML or its event API is not
    there. `now`: the clock the problem lines are stamped with."""
    watch = await trio.to_thread.run_sync(_Watch.open, nvml) if nvml is not None else None
    task_status.started()
    if watch is None:
        return
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
            if uuid is None:
                # Which GPU is not known: every GPU is read again now, so that whichever it
                # was shows what NVML says of it (lost, a recovery action, a pending remap).
                log.warning("Xid %d on a GPU NVML did not name; reading every GPU again", xid)
                on_unresolved(xid)
                continue
            problem = xid_problem(xid, now())
            if problem is None:
                log.info("GPU %s: Xid %d (an application fault; the GPU stays in use)", uuid, xid)
                continue
            if on_problem(uuid, problem) is not False:
                log.warning("GPU %s: %s; it is not placed again until it is reset", uuid, problem)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(watch.close)

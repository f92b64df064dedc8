"""GPU release tracking: the GPUs of an ended engine session stay out until the reader
shows their memory back, and a start on GPUs still releasing waits a moment, then is refused.

The verdicts are gpus/release.py's and gpus/claims.py's (pure); this is the trio shell
that reads the GPUs and /proc in a thread and keeps the sessions still releasing."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

import trio
from attrs import define, field

from llmgw.agent.gpus.claims import check_gpus
from llmgw.agent.gpus.memory import GpuMemory, GpuMemoryReader
from llmgw.agent.gpus.release import release_reasons
from llmgw.agent.process import procs
from llmgw.model.engine import EngineSpec

log = logging.getLogger(__name__)

# Seconds between readings of a stopped engine's GPUs while their memory comes back.
RELEASE_POLL = 1.0
# A start that finds one of its GPUs still releasing (the replica's previous session has
# just ended: a rolling restart on the same GPUs) reads again for this long before it is
# refused; the driver frees a process's memory a moment after the process is gone.
START_RELEASE_WAIT = 3.0
START_RELEASE_POLL = 0.25

Reading = Mapping[str, GpuMemory]


@define(eq=False)
class Release:
    """The GPUs of one ended engine session, until their memory is back."""

    replica_id: str
    gpus: tuple[str, ...]
    pids: frozenset[int]  # the session's processes, the leader included
    began: float  # trio's clock when the session ended
    reasons: dict[str, str]  # uuid -> why it is still releasing; empty: released
    alive: frozenset[int] = frozenset()  # of `pids`, those /proc still had last time
    late: bool = False  # past release_timeout (logged once)
    # uuid -> MiB free right before the engine was spawned: its memory is back once free
    # is that again (an idle board's own reservation is no leftover). Absent (an adopted
    # engine): judged against the total alone.
    free_before: Mapping[str, int] = field(factory=dict)


async def watch_release(
    rel: Release,
    read: Callable[[], Awaitable[Reading | None]],
    states: Callable[[frozenset[int]], Awaitable[dict[int, str | None]]],
    *,
    timeout: float,
    on_change: Callable[[], None],
    poll: float = RELEASE_POLL,
) -> None:
    """Read `rel`'s GPUs every `poll` seconds until none is releasing. Past `timeout` the
    reasons name the stuck pid and its state; it goes on reading (the GPUs stay out).
    `read` (the GPUs) and `states` (/proc states of pids) run the blocking reads in a
    thread."""
    while True:
        await refresh_release(rel, await read(), await states(rel.pids),
                              timeout=timeout, on_change=on_change)
        if not rel.reasons:
            return
        await trio.sleep(poll)


async def refresh_release(rel: Release, reading: Reading | None,
                          states: Mapping[int, str | None], *, timeout: float,
                          on_change: Callable[[], None]) -> None:
    elapsed = trio.current_time() - rel.began
    reasons = release_reasons(rel.gpus, rel.pids, reading, replica_id=rel.replica_id,
                              elapsed=elapsed, timeout=timeout, states=states,
                              free_before=rel.free_before)
    rel.alive = frozenset(p for p in rel.pids if states.get(p) is not None)
    if elapsed >= timeout and reasons and not rel.late:
        rel.late = True
        for uuid, why in reasons.items():
            log.warning("GPU %s: %s", uuid, why)
    if reasons != rel.reasons:
        if not reasons:
            log.info("engine %s: GPUs %s released after %.1fs", rel.replica_id,
                     ",".join(rel.gpus), elapsed)
        rel.reasons = reasons
        on_change()


def _pid_states(pids: frozenset[int]) -> dict[int, str | None]:
    return {pid: procs.state_of(pid) for pid in pids}


async def pid_states_async(pids: frozenset[int]) -> dict[int, str | None]:
    return await trio.to_thread.run_sync(_pid_states, pids)


class GpuReleases:
    """The node's GPUs as the supervisor sees them: read before each spawn, watched after
    each engine with GPUs ends, until its memory is back."""

    def __init__(self, reader: GpuMemoryReader | None, *, timeout: float,
                 on_change: Callable[[], None]) -> None:
        # Read right before each spawn of an engine with GPUs (their NVML indices, health,
        # free memory and holders) and after each such engine ends (its memory back).
        # None: specs with GPUs are refused, since no CUDA index can be given to them.
        self.reader = reader
        self.timeout = timeout
        self.on_change = on_change
        self.start_wait = START_RELEASE_WAIT
        self.sessions: list[Release] = []
        # replica id -> each GPU's free MiB read right before its engine's spawn, until its
        # record keeps it (EngineRecord.gpu_free_before: an adopted engine has it too).
        self.free_before: dict[str, dict[str, int]] = {}

    def releasing(self) -> dict[str, str]:
        """GPU UUID -> why it is not back yet, for each GPU of an ended engine whose
        memory has not come back (Gpu.releasing in the inventory)."""
        out: dict[str, str] = {}
        for rel in self.sessions:
            for uuid, why in rel.reasons.items():
                out.setdefault(uuid, why)
        return out

    def alive(self) -> set[int]:
        """Processes of ended sessions still alive while their GPUs release."""
        return {p for rel in self.sessions for p in rel.alive}

    def read(self) -> Reading | None:
        """One reading of the GPUs (blocking); None when there is no reader or it fails."""
        if self.reader is None:
            return None
        try:
            return self.reader()
        except Exception as exc:  # a reader bug or an NVML error: "cannot read" for now
            log.warning("reading the GPUs failed: %s", exc)
            return None

    async def read_async(self) -> Reading | None:
        return await trio.to_thread.run_sync(self.read)

    async def indices(self, spec: EngineSpec) -> dict[str, int] | str:
        """The NVML index of each of the spec's GPUs, or why it must not start now.

        No GPUs: nothing to map, nothing to check. GPUs with no reader, or a reader that
        cannot read: refused, since CUDA_VISIBLE_DEVICES takes indices, and a guess (the
        position in the spec, the last inventory's) could hand the engine someone else's
        GPU. The integrator gives GPU-less or NVML-less nodes a reader made from the
        inventory (gpu_memory.from_inventory)."""
        if not spec.gpus:
            return {}
        if self.reader is None:
            return (f"no GPU reader on this agent to map GPUs {','.join(spec.gpus)} to "
                    "CUDA devices")
        deadline = trio.current_time() + self.start_wait
        while True:
            reading = await self.read_async()
            if reading is None:
                return f"cannot read the GPUs (NVML) to map {','.join(spec.gpus)} to CUDA devices"
            mine = [r for r in self.sessions if set(r.gpus) & set(spec.gpus) and r.reasons]
            for rel in mine:  # this fresh reading may show them back already
                states = await pid_states_async(rel.pids)
                await refresh_release(rel, reading, states, timeout=self.timeout,
                                      on_change=self.on_change)
            own = frozenset(p for r in self.sessions if r.replica_id == spec.replica_id
                            for p in r.pids)
            verdict = check_gpus(spec, reading, self.releasing(), own)
            if not isinstance(verdict, str):
                self.free_before[spec.replica_id] = {
                    u: reading[u].free for u in spec.gpus if u in reading}
            if (not isinstance(verdict, str) or not any(u in self.releasing() for u in spec.gpus)
                    or trio.current_time() >= deadline):
                return verdict
            await trio.sleep(START_RELEASE_POLL)

    def begin(self, nursery: trio.Nursery | None, replica_id: str, gpus: tuple[str, ...],
              pids: frozenset[int], free_before: tuple[int, ...]) -> None:
        """Hold an ended engine's GPUs as releasing until the reader shows its memory
        back. Without a reader there is nothing to watch with: they are free at once."""
        if not gpus or self.reader is None or nursery is None:
            self.on_change()  # its pids left engine_pids()
            return
        rel = Release(replica_id, gpus, pids, trio.current_time(),
                      {u: f"releasing after {replica_id} stopped" for u in gpus},
                      alive=pids, free_before=dict(zip(gpus, free_before, strict=False)))
        self.sessions.append(rel)
        self.on_change()
        nursery.start_soon(self._watch, rel)

    async def _watch(self, rel: Release) -> None:
        # Cancelled (the agent stopping) with memory still held, the release ends with the
        # agent: a restarted one sees the stuck process as foreign on the GPU, so
        # placement still avoids it.
        try:
            await watch_release(rel, self.read_async, pid_states_async,
                                timeout=self.timeout, on_change=self.on_change)
        except Exception:  # a bug here must not take the agent down
            log.exception("engine %s: watching its GPUs' release failed; they stay out "
                          "until the agent restarts", rel.replica_id)
            return
        self.sessions.remove(rel)

"""Whether an engine's GPUs have come back after its session ended: pure, readings in.

After a stop, a crash or a SIGKILL, the driver frees a process's memory only once the
process is fully gone; one stuck in the driver (state D) keeps it for as long as it is
stuck. Until NVML lists no process of that session on a GPU and its free memory is back,
the GPU is "releasing" and placement leaves it alone.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.agent.gpus.memory import GpuMemory

# MiB of a GPU's memory that may be missing from "free" with no process to account for
# it: the driver's own reservation (a few hundred MiB on an idle H100 in NVML's "used")
# and figures that NVML updates a moment apart. 1 GiB is over the reservation seen on
# current boards and far below what any engine's leftover holds (its KV cache alone is
# most of the GPU), so a leftover is never mistaken for slack.
SLACK_MIB = 1024

# /proc/<pid>/stat state letters, in words for an operator.
_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "uninterruptible: stuck in the driver",
    "Z": "zombie: its parent has not reaped it",
    "T": "stopped by a signal",
    "t": "stopped by a tracer",
    "X": "dead",
    "I": "idle",
}


def gib(mib: int) -> str:
    """MiB as an operator reads it: whole GiB from 1 GiB on."""
    return f"{round(mib / 1024)} GiB" if mib >= 1024 else f"{mib} MiB"


def state_text(pid: int, state: str | None) -> str:
    """ "pid 4242 (D, uninterruptible: stuck in the driver)"; None: not in /proc."""
    if state is None:
        return f"pid {pid} (not in this node's /proc)"
    words = _STATES.get(state)
    return f"pid {pid} ({state}, {words})" if words else f"pid {pid} ({state})"


def still_held(gpu: GpuMemory | None, pids: frozenset[int], slack: int = SLACK_MIB,
               free_before: int | None = None) -> tuple[tuple[int, int], ...] | str | None:
    """What of the session is still on `gpu`. `free_before`: MiB free right before the
    engine was spawned, when the agent read it; memory is back once free is that again
    (less the slack), or the whole board less what other processes hold is, whichever
    asks less: a board's own idle reservation is no leftover, nor is memory a foreign
    process took since the spawn.

    None: released. A tuple: the session's processes NVML still lists, (pid, MiB).
    A str: no process listed, but memory missing (the text says how much), or the GPU
    cannot be read.
    """
    if gpu is None:
        return "the GPU is not readable on this node now"
    listed = tuple((p.pid, p.memory) for p in gpu.processes if p.pid in pids)
    if listed:
        return listed
    foreign = [p.memory for p in gpu.processes if p.pid not in pids]
    if any(m <= 0 for m in foreign):
        # A process whose memory NVML does not report (MIG, older drivers): the figure
        # cannot be balanced; the session's absence from the list is all there is to go on.
        return None
    expected = gpu.total - sum(foreign) - slack
    if free_before is not None:
        expected = min(expected, free_before - slack)
    if gpu.free >= expected:
        return None
    return f"{gib(expected + slack - gpu.free)} not back yet with no process listed"


def release_reasons(
    gpus: tuple[str, ...],
    pids: frozenset[int],
    reading: Mapping[str, GpuMemory] | None,
    *,
    replica_id: str,
    elapsed: float,
    timeout: float,
    states: Mapping[int, str | None],
    slack: int = SLACK_MIB,
    free_before: Mapping[str, int] | None = None,
) -> dict[str, str]:
    """The GPUs of `gpus` still releasing, each with the reason an operator sees.

    `pids` are the ended session's processes; `states` their /proc state letters (None:
    gone), read by the caller. Past `timeout` the reason names the stuck pid and its state.
    """
    out: dict[str, str] = {}
    late = elapsed >= timeout
    for uuid in gpus:
        if reading is None:
            out[uuid] = f"{replica_id} stopped; cannot read the GPUs to see its memory back"
            continue
        held = still_held(reading.get(uuid), pids, slack, (free_before or {}).get(uuid))
        if held is None:
            continue
        if isinstance(held, str):
            what = held
            if late:
                alive = [state_text(p, states.get(p)) for p in sorted(pids)
                         if states.get(p) is not None]
                if alive:
                    what += "; still alive: " + ", ".join(alive)
        else:
            parts = []
            for pid, mib in held:
                who = state_text(pid, states.get(pid)) if late else f"pid {pid}"
                parts.append(f"{who} holds {gib(mib)}" if mib > 0 else f"{who} is still listed")
            what = ", ".join(parts)
        if late:
            out[uuid] = f"not released {elapsed:.0f}s after {replica_id} stopped: {what}"
        else:
            out[uuid] = f"releasing after {replica_id} stopped: {what}"
    return out

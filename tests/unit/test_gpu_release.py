"""A stopped engine's GPUs stay releasing until NVML lists none of its processes and the
memory is back; past the bound the stuck pid and its /proc state are named."""

from __future__ import annotations

import trio
import trio.testing
from attrs import evolve

from fakes.supervision import GIB, FakeGpus, gpu
from llmgw.agent.gpus.memory import GpuMemory
from llmgw.agent.gpus.release import SLACK_MIB, gib, release_reasons, state_text, still_held
from llmgw.agent.lifecycle.releases import Release as _Release
from llmgw.agent.lifecycle.releases import watch_release
from llmgw.model.inventory import GpuProcess

SESSION = frozenset({4242, 4243})


def _reasons(reading: dict[str, GpuMemory] | None, *, elapsed: float = 5.0,
             states: dict[int, str | None] | None = None) -> dict[str, str]:
    return release_reasons(("GPU-a",), SESSION, reading, replica_id="r1", elapsed=elapsed,
                           timeout=120.0, states=states or {})


def test_gib() -> None:
    assert gib(61 * GIB + 300) == "61 GiB"
    assert gib(500) == "500 MiB"


def test_state_text() -> None:
    assert state_text(4242, "D") == "pid 4242 (D, uninterruptible: stuck in the driver)"
    assert state_text(7, "Z") == "pid 7 (Z, zombie: its parent has not reaped it)"
    assert state_text(7, "?") == "pid 7 (?)"
    assert state_text(7, None) == "pid 7 (not in this node's /proc)"


def test_released_when_no_session_process_and_memory_back() -> None:
    idle = gpu("GPU-a", 3)
    assert still_held(idle, SESSION) is None
    assert _reasons({"GPU-a": idle}) == {}
    # within the slack (the driver's own reservation): back
    assert still_held(evolve(idle, free=idle.total - SLACK_MIB), SESSION) is None


def test_back_once_as_free_as_before_the_spawn() -> None:
    """A board whose idle reservation is above the slack (the real-engine tier's fake L40S
    shows 1068 MiB used with nothing on it) was never released by the total alone; the
    free memory read before the spawn says what "back" is."""
    g = gpu("GPU-a", 3, free=80 * GIB - 1500)
    assert isinstance(still_held(g, SESSION), str)
    assert still_held(g, SESSION, free_before=80 * GIB - 1500) is None
    assert release_reasons(("GPU-a",), SESSION, {"GPU-a": g}, replica_id="r1", elapsed=5.0,
                           timeout=120.0, states={}, free_before={"GPU-a": 80 * GIB - 1500}) == {}
    # Still far from it: not back, and the reason counts from the baseline.
    low = evolve(g, free=50 * GIB)
    assert still_held(low, SESSION, free_before=80 * GIB - 1500) == \
        "29 GiB not back yet with no process listed"  # 80 GiB - 1500 MiB - 50 GiB
    # A foreign process that took memory since the spawn: the board less it is enough.
    taken = gpu("GPU-a", 3, free=40 * GIB, processes=(GpuProcess(999, "python train.py", 40 * GIB),))
    assert still_held(taken, SESSION, free_before=80 * GIB) is None


def test_a_listed_session_process_holds_it() -> None:
    g = gpu("GPU-a", 3, processes=(GpuProcess(4242, "vllm", 30 * GIB),), free=50 * GIB)
    assert still_held(g, SESSION) == ((4242, 30 * GIB),)
    assert _reasons({"GPU-a": g}) == {"GPU-a": "releasing after r1 stopped: pid 4242 holds 30 GiB"}


def test_memory_missing_with_no_process_listed() -> None:
    g = gpu("GPU-a", 3, free=60 * GIB)
    assert _reasons({"GPU-a": g}) == {
        "GPU-a": "releasing after r1 stopped: 20 GiB not back yet with no process listed"}


def test_foreign_memory_is_not_ours_to_wait_for() -> None:
    """A training job holding 40 GiB: the GPU is back once the rest is free."""
    g = gpu("GPU-a", 3, free=40 * GIB, processes=(GpuProcess(999, "python train.py", 40 * GIB),))
    assert still_held(g, SESSION) is None
    short = evolve(g, free=30 * GIB)
    assert still_held(short, SESSION) == "10 GiB not back yet with no process listed"


def test_unreported_process_memory_trusts_the_list() -> None:
    """MIG and older drivers list processes with no memory figure: nothing to balance."""
    g = gpu("GPU-a", 3, free=10 * GIB, processes=(GpuProcess(999, "other", 0),))
    assert still_held(g, SESSION) is None


def test_past_the_bound_the_stuck_pid_and_its_state_are_named() -> None:
    g = gpu("GPU-a", 3, processes=(GpuProcess(4242, "vllm", 30 * GIB),), free=50 * GIB)
    got = _reasons({"GPU-a": g}, elapsed=125.0, states={4242: "D", 4243: None})
    assert got == {"GPU-a": "not released 125s after r1 stopped: pid 4242 (D, uninterruptible: "
                            "stuck in the driver) holds 30 GiB"}
    # no process listed, but one of the session still alive: named too
    g2 = gpu("GPU-a", 3, free=60 * GIB)
    got = _reasons({"GPU-a": g2}, elapsed=125.0, states={4242: "D", 4243: None})
    assert got["GPU-a"].endswith(
        "20 GiB not back yet with no process listed; still alive: pid 4242 (D, "
        "uninterruptible: stuck in the driver)")


def test_unreadable() -> None:
    assert _reasons(None) == {"GPU-a": "r1 stopped; cannot read the GPUs to see its memory back"}
    assert _reasons({}) == {
        "GPU-a": "releasing after r1 stopped: the GPU is not readable on this node now"}


async def _gone(pids: frozenset[int]) -> dict[int, str | None]:
    return {p: None for p in pids}


async def _stuck(pids: frozenset[int]) -> dict[int, str | None]:
    return {4242: "D"}


def _rel(began: float) -> _Release:
    return _Release("r1", ("GPU-a",), SESSION, began, {"GPU-a": "releasing after r1 stopped"},
                    alive=SESSION)


async def test_polls_every_second_until_back(autojump_clock: trio.testing.MockClock) -> None:
    gpus = FakeGpus(gpu("GPU-a", 3))
    gpus.hold("GPU-a", 4242, 30 * GIB, "vllm")
    rel = _rel(trio.current_time())
    changes: list[dict[str, str]] = []

    async def free_later() -> None:
        await trio.sleep(10.5)
        gpus.drop("GPU-a", 4242)

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(free_later)
        await watch_release(rel, gpus.read, _gone, timeout=120.0,
                            on_change=lambda: changes.append(dict(rel.reasons)))
    assert trio.current_time() - t0 == 11.0  # the first reading after the memory came back
    assert gpus.reads == 12  # at 0, 1, ..., 11
    assert changes == [{"GPU-a": "releasing after r1 stopped: pid 4242 holds 30 GiB"}, {}]
    assert rel.reasons == {} and rel.alive == frozenset()


async def test_past_the_bound_it_names_the_stuck_pid_and_keeps_polling(
        autojump_clock: trio.testing.MockClock) -> None:
    gpus = FakeGpus(gpu("GPU-a", 3))
    gpus.hold("GPU-a", 4242, 30 * GIB, "vllm")
    rel = _rel(trio.current_time())
    seen: list[tuple[float, str]] = []
    t0 = trio.current_time()

    def on_change() -> None:
        seen.append((trio.current_time() - t0, rel.reasons.get("GPU-a", "")))

    with trio.move_on_after(300):
        await watch_release(rel, gpus.read, _stuck, timeout=120.0, on_change=on_change)
    assert gpus.reads == 300  # at 0, 1, ..., 299: still reading at the end
    late = [(t, why) for t, why in seen if why.startswith("not released")]
    assert late[0] == (120.0, "not released 120s after r1 stopped: pid 4242 (D, uninterruptible: "
                              "stuck in the driver) holds 30 GiB")
    assert all(why for _, why in seen)  # never released
    assert rel.alive == frozenset({4242})

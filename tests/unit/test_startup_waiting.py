"""A stalled start does not look like progress (issue 30 item 5): the startup deadline
judges what the new log bytes say. vLLM's "No available shared memory broadcast block
found in 60 seconds" (shm_broadcast.py, LONG_WAIT_TIME_LOG_MSG, logged every
VLLM_RINGBUFFER_WARNING_INTERVAL seconds) comes from a first forward deadlocked across TP
ranks as well as from a long compile; counted as progress, a deadlocked start held its
GPUs until startup_max. A fake engine writes that line on trio's autojump clock."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.lifecycle.health import watch_health
from llmgw.agent.lifecycle.health_watch import _new_bytes
from llmgw.agent.lifecycle.startup_deadline import TAIL_MAX, StartupDeadline, says_progress

# As vLLM 0.32's logger formats it (vllm/logger.py _FORMAT: "(%(vllm_process_name)s
# pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s").
WAIT = (b"(EngineCore_DP0 pid=4242) INFO 12-05 16:00:00 [shm_broadcast.py:750] No available "
        b"shared memory broadcast block found in 60 seconds. This typically happens when some "
        b"processes are hanging or doing some time-consuming work (e.g. compilation, "
        b"weight/kv cache quantization).\n")
LOADING = b"(EngineCore_DP0 pid=4242) INFO 12-05 16:00:00 [default_loader.py:291] Loading weights took 41.2 seconds\n"


def test_waiting_lines_are_not_progress_and_any_other_line_is() -> None:
    assert not says_progress(WAIT)
    assert not says_progress(WAIT * 3 + b"\n\r\n")
    assert says_progress(LOADING)
    assert says_progress(WAIT + LOADING)
    # A progress bar rewrites its line with \r: each state is a line of its own.
    assert says_progress(b"\rLoading safetensors checkpoint shards:  50% Completed | 2/4")
    # A read that caught the waiting line half written: either half is still known.
    for cut in (WAIT.index(b"This"), WAIT.index(b"time-consuming")):
        assert not says_progress(WAIT[:cut]) and not says_progress(WAIT[cut:])
    assert not says_progress(b"") and not says_progress(b"\n \n")


@given(st.lists(st.sampled_from([WAIT, b"\n", b"\r", b" "]), max_size=20))
def test_waiting_lines_and_blanks_in_any_mix_are_no_progress(parts: list[bytes]) -> None:
    assert not says_progress(b"".join(parts))


@given(st.binary(max_size=3000))
def test_any_bytes_are_judged(new: bytes) -> None:
    assert isinstance(says_progress(new), bool)


def test_observe_judges_the_new_bytes() -> None:
    d = StartupDeadline.start(0.0, 100.0, cap=3600.0, log_size=10)
    waited = d.observe(10 + len(WAIT), 60.0, new=WAIT)
    assert waited.deadline == 100.0 and waited.last_size == 10 + len(WAIT)  # read past
    assert waited.expired(100.0) == ("not ready within 100s (no progress for 100s, the log saying "
                                     "only that it waits (a hang, or a compile longer than startup_timeout))")
    moved = waited.observe(waited.last_size + len(LOADING), 90.0, new=LOADING)
    assert moved.deadline == 190.0 and not moved.waiting
    # Unread bytes (None), more than were read, a rotation, or a download: progress.
    assert d.observe(10 + len(WAIT), 60.0).deadline == 160.0
    assert d.observe(10 + TAIL_MAX + 5, 60.0, new=WAIT[-10:]).deadline == 160.0
    assert d.observe(5, 60.0, new=b"").deadline == 160.0
    assert d.observe(10 + len(WAIT), 60.0, downloaded=1, new=WAIT).deadline == 160.0


def test_the_shell_reads_the_new_bytes_bounded(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"x" * 10 + WAIT)
    assert _new_bytes(str(log), 10, 10 + len(WAIT)) == WAIT
    assert _new_bytes(str(log), 10, 10) == b""
    big = b"y" * (TAIL_MAX + 100)
    log.write_bytes(big)
    assert _new_bytes(str(log), 0, len(big)) == big[-TAIL_MAX:]
    assert _new_bytes(str(tmp_path / "gone"), 0, 5) is None


async def _never_ready() -> bool:
    return False


def _append(log: Path, data: bytes) -> None:
    with log.open("ab") as f:
        f.write(data)


def _size(log: Path) -> int:
    return log.stat().st_size


async def _run(log: Path, *, progress_at: float | None = None) -> float:
    """A fake engine that writes WAIT every 20 s (and, at `progress_at`, one LOADING line)
    under watch_health, fed as the supervisor feeds it; the time it is given up on."""
    t0 = trio.current_time()
    _append(log, b"")
    clock = StartupDeadline.start(t0, 60.0, cap=3600.0, log_size=0)
    given_up: list[float] = []

    async def engine() -> None:
        n = 0
        while True:
            await trio.sleep(20.0)
            n += 1
            _append(log, WAIT + (LOADING if n * 20.0 == progress_at else b""))

    def deadline(now: float) -> float:
        nonlocal clock
        size = _size(log)
        clock = clock.observe(size, now, 0, _new_bytes(str(log), clock.last_size, size))
        return clock.deadline

    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine)
        with trio.move_on_after(4000):
            await watch_health(_never_ready, interval=5.0, startup_timeout=60.0,
                               on_event=lambda e: given_up.append(trio.current_time() - t0),
                               deadline=deadline)
        nursery.cancel_scope.cancel()
    return given_up[0]


async def test_a_start_that_only_says_it_waits_is_given_up_on_after_startup_timeout(
        autojump_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    """Before: each line extended the deadline, and it ran to the 3600 s cap."""
    assert 60.0 <= await _run(tmp_path / "engine.log") < 70.0


async def test_a_real_progress_line_still_extends(
        autojump_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    assert 100.0 <= await _run(tmp_path / "engine.log", progress_at=40.0) < 110.0

"""The startup deadline: extended by progress (the log grows), floored by the weights'
size, capped; and watch_health asking it after each probe, on trio's clock."""

from __future__ import annotations

import trio
import trio.testing

from llmgw.agent.lifecycle.health import watch_health
from llmgw.agent.lifecycle.startup_deadline import WEIGHTS_READ_RATE, StartupDeadline, weights_floor


def test_no_progress_gives_up_after_the_timeout() -> None:
    d = StartupDeadline.start(0.0, 600.0, cap=3600.0)
    assert d.deadline == 600.0
    assert d.expired(599.0) == ""
    assert d.expired(612.0) == "not ready within 612s (no progress for 612s)"


def test_progress_extends_from_the_last_growth() -> None:
    d = StartupDeadline.start(0.0, 600.0, cap=3600.0, log_size=100)
    d = d.observe(100, 10.0)  # the same size: no progress
    assert d.deadline == 600.0
    d = d.observe(5000, 400.0)
    assert d.deadline == 1000.0
    d = d.observe(5000, 900.0)
    assert d.expired(999.0) == ""
    assert d.expired(1012.0) == "not ready within 1012s (no progress for 612s)"


def test_a_rotated_log_is_progress_too() -> None:
    d = StartupDeadline.start(0.0, 60.0, cap=3600.0, log_size=10_000).observe(50, 30.0)
    assert d.deadline == 90.0


def test_cap_bounds_the_extension() -> None:
    d = StartupDeadline.start(0.0, 600.0, cap=3600.0)
    for t in range(0, 4000, 100):
        d = d.observe(t + 1, float(t))
    assert d.deadline == 3600.0
    assert d.expired(3601.0) == "not ready within 3601s (the 3600s cap)"


def test_weights_floor() -> None:
    # 140 GB (a 70B model in bf16) at the assumed rate, on top of the timeout.
    size = 140 * 10**9
    assert weights_floor(600.0, size) == 600.0 + size / WEIGHTS_READ_RATE
    d = StartupDeadline.start(0.0, 600.0, cap=3600.0, size_bytes=size)
    assert d.deadline == 1300.0  # no progress at all: still not before the floor
    assert d.expired(1299.0) == ""
    assert "no progress for 1300s" in d.expired(1300.0)
    assert weights_floor(600.0, -5) == 600.0  # unknown or nonsense: no floor


def test_a_floor_above_the_cap_wins() -> None:
    d = StartupDeadline.start(0.0, 600.0, cap=1000.0, size_bytes=10**12)  # 1 TB: 5000 s
    assert d.deadline == 5600.0


async def _never_ready() -> bool:
    return False


async def test_watch_health_follows_a_moving_deadline(autojump_clock: trio.testing.MockClock) -> None:
    """The log grows for 100 s, then stops: failed 30 s after the last growth, not 30 s
    after spawn (the old fixed deadline)."""
    t0 = trio.current_time()
    clock = StartupDeadline.start(t0, 30.0, cap=3600.0)
    events: list[float] = []

    def deadline(now: float) -> float:
        nonlocal clock
        clock = clock.observe(int(min(now - t0, 100.0)), now)  # bytes = seconds, up to 100
        return clock.deadline

    with trio.move_on_after(1000):
        await watch_health(_never_ready, interval=2.0, startup_timeout=30.0,
                           on_event=lambda e: events.append(trio.current_time() - t0),
                           deadline=deadline)
    assert events == [130.0]
    assert clock.expired(t0 + 130.0) == "not ready within 130s (no progress for 30s)"


async def test_watch_health_stops_at_the_cap(autojump_clock: trio.testing.MockClock) -> None:
    t0 = trio.current_time()
    clock = StartupDeadline.start(t0, 30.0, cap=300.0)
    events: list[float] = []

    def deadline(now: float) -> float:
        nonlocal clock
        clock = clock.observe(int(now - t0), now)  # grows forever
        return clock.deadline

    with trio.move_on_after(1000):
        await watch_health(_never_ready, interval=2.0, startup_timeout=30.0,
                           on_event=lambda e: events.append(trio.current_time() - t0),
                           deadline=deadline)
    assert events == [300.0]
    assert clock.expired(t0 + 300.0) == "not ready within 300s (the 300s cap)"

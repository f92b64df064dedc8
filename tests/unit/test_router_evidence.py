"""Issue 20 item 1, the pure parts: the loop's lateness, ejection on evidence only, the
least bad replica when all are ejected, and the admission queue (on autojump_clock)."""

from __future__ import annotations

import math
import random

import pytest
import trio
import trio.testing

from llmgw.router.connection.lag import KEEP, LagMeter, watch_lag
from llmgw.router.routing.admission import Gate, Refused
from llmgw.router.routing.balancer import Pool, Replica

# ---- LagMeter -------------------------------------------------------------------------


def test_on_time_wake_ups_leave_no_trace() -> None:
    m = LagMeter()
    for i in range(100):
        m.due = i * 0.05
        m.record(i * 0.05, i * 0.05 + 0.0005)
    m.due = 100 * 0.05
    assert m.late_between(0.0, 5.0) == 0.0
    assert m.total == 0.0


def test_late_wake_ups_overlapping_the_window_are_summed() -> None:
    m = LagMeter()
    m.record(1.0, 1.5)  # nothing ran over [1.0, 1.5]
    m.record(2.0, 2.3)  # nor over [2.0, 2.3]
    m.due = 10.0
    assert m.late_between(0.0, 3.0) == pytest.approx(0.8)
    assert m.late_between(1.2, 3.0) == pytest.approx(0.6)  # only the part inside the window
    assert m.late_between(2.4, 3.0) == 0.0
    assert m.late_between(2.1, 2.2) == pytest.approx(0.1)  # never more than the window


def test_the_tickers_pending_lateness_counts_before_it_runs() -> None:
    """A timeout handled in the same round as the overdue ticker, before it ran."""
    m = LagMeter()
    m.due = 5.0
    assert m.late_now(5.4) == pytest.approx(0.4)
    assert m.late_between(4.9, 5.4) == pytest.approx(0.4)
    assert m.late_between(5.2, 5.4) == pytest.approx(0.2)


def test_the_history_is_bounded() -> None:
    m = LagMeter()
    for i in range(KEEP * 3):
        m.record(float(i), i + 0.5)
    assert len(m._marks) == KEEP
    assert m.take_worst() == pytest.approx(0.5)
    m.record(0.0, 0.0)
    assert m.take_worst() == 0.0


async def test_watch_lag_sees_a_loop_that_was_away(autojump_clock: trio.testing.MockClock) -> None:
    m = LagMeter()
    async with trio.open_nursery() as n:
        n.start_soon(watch_lag, m, 0.05)
        await trio.sleep(1.0)
        t0 = trio.current_time()
        autojump_clock.jump(0.7)  # what a blocking handler or a CPU hog does to the loop
        assert m.late_between(t0, trio.current_time()) == pytest.approx(0.7, abs=0.06)
        await trio.sleep(0.2)
        assert m.late_between(t0, trio.current_time()) == pytest.approx(0.7, abs=0.06)
        assert m.late_between(trio.current_time() - 0.1, trio.current_time()) == 0.0
        n.cancel_scope.cancel()
    assert m.due == math.inf


# ---- ejection on evidence -------------------------------------------------------------


def pool_of(n: int) -> tuple[Pool, list[Replica]]:
    rs = [Replica(f"r{i}", f"http://127.0.0.1:{9000 + i}") for i in range(n)]
    return Pool(rs, rng=random.Random(0)), rs


def test_one_failure_ejects_nobody() -> None:
    pool, rs = pool_of(2)
    rs[1].last_ok = 1.0
    assert not pool.note_failure(rs[0], 1.0, 3)
    assert not pool.note_failure(rs[0], 1.1, 3)
    assert pool.note_failure(rs[0], 1.2, 3)  # the third, while r1 answers


def test_a_burst_in_which_every_replica_fails_ejects_none() -> None:
    pool, rs = pool_of(4)
    for r in rs:
        r.last_ok = 0.5  # all answered before the burst
    for i in range(40):
        for r in rs:
            assert not pool.note_failure(r, 1.0 + i * 0.001, 3)


def test_others_must_have_answered_since_the_failures_began() -> None:
    pool, rs = pool_of(2)
    rs[1].last_ok = 0.9  # before r0's first failure at 1.0: no evidence
    for t in (1.0, 1.1, 1.2, 1.3):
        assert not pool.note_failure(rs[0], t, 3)
    rs[1].last_ok = 1.35
    assert pool.note_failure(rs[0], 1.4, 3)


def test_the_last_replica_not_ejected_is_never_ejected() -> None:
    pool, rs = pool_of(2)
    rs[1].last_ok = 2.0
    rs[1].ejected_until = 50.0  # answered, but ejected since: r0 is the last one standing
    for t in (3.0, 3.1, 3.2, 3.3):
        assert not pool.note_failure(rs[0], t, 3)


def test_with_all_ejected_the_least_bad_is_tried() -> None:
    pool, rs = pool_of(3)
    rs[0].ejected_until, rs[1].ejected_until, rs[2].ejected_until = 30.0, 12.0, 20.0
    assert all(pool.choose(5.0, 2.0) is rs[1] for _ in range(10))
    assert pool.choose(5.0, 2.0, exclude=(rs[1],)) is rs[2]
    assert pool.choose(5.0, 2.0, exclude=tuple(rs)) is None


# ---- admission --------------------------------------------------------------------------


async def test_gate_serves_waiters_in_order_and_refuses_beyond_the_queue(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = Gate(size=3, wait=100.0)
    order: list[int] = []
    refused: list[tuple[int, str]] = []
    assert gate.try_enter(2) and gate.try_enter(2)
    assert not gate.try_enter(2)

    async def one(i: int) -> None:
        try:
            await gate.enter(2, trio.current_time())
        except Refused as exc:
            refused.append((i, exc.why))
            return
        order.append(i)
        await trio.sleep(1.0)
        gate.leave(2)

    async with trio.open_nursery() as n:
        for i in range(6):
            n.start_soon(one, i)
            await trio.sleep(0.01)  # arrive in order
        assert gate.queued == 3
        assert refused == [(3, "queue_full"), (4, "queue_full"), (5, "queue_full")]
        gate.leave(2)
        await trio.sleep(0.01)
        gate.leave(2)
    assert order == [0, 1, 2]
    assert gate.active == 0 and gate.queued == 0


async def test_gate_refuses_after_the_wait_and_leaks_no_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = Gate(size=10, wait=2.0)
    assert gate.try_enter(1)
    t0 = trio.current_time()
    with pytest.raises(Refused) as exc:
        await gate.enter(1, t0)
    assert exc.value.why == "queue_timeout"
    assert trio.current_time() - t0 == pytest.approx(2.0)
    assert gate.queued == 0 and gate.active == 1
    with trio.move_on_after(0.5):  # a waiter cancelled (its handler ended) holds nothing
        await gate.enter(1, trio.current_time())
    gate.leave(1)
    assert gate.active == 0


async def test_more_replicas_let_waiters_in(autojump_clock: trio.testing.MockClock) -> None:
    gate = Gate(size=10, wait=100.0)
    assert gate.try_enter(1)
    got: list[int] = []

    async def one(i: int) -> None:
        await gate.enter(1, trio.current_time())
        got.append(i)

    async with trio.open_nursery() as n:
        for i in range(3):
            n.start_soon(one, i)
            await trio.sleep(0.01)  # arrive in order
        await trio.sleep(1.0)
        assert got == [] and gate.queued == 3
        gate.pump(3)  # the table grew: three slots
        await trio.sleep(0.1)
        # the two oldest got the slots (woken in one batch: their order within it is trio's)
        assert sorted(got) == [0, 1] and gate.queued == 1
        gate.leave(3)
    assert sorted(got[:2]) == [0, 1] and got[2] == 2

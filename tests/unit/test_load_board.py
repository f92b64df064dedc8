"""The routers' load reports summed per deployment (issue 25): server/elastic/load_board.py and the
autoscaler's step (server/elastic/autoscaler.py), without I/O."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from attrs import evolve
from hypothesis import given
from hypothesis import strategies as st

from llmgw.config.deployment import parse_deployment
from llmgw.model.deployment import Deployment
from llmgw.server.elastic.autoscaler import Autoscaler, Change, served_names
from llmgw.server.elastic.load_board import LoadBoard
from llmgw.transport import codec
from llmgw.transport.messages import Request
from llmgw.transport.requests import LoadReportOp, ModelLoad

MAP = {"m": "d", "other": "e"}


def test_two_routers_are_summed_not_doubled_or_dropped() -> None:
    b = LoadBoard()
    b.put("r1", 0.0, 1.0, {"m": ModelLoad(in_flight=3, waiting=1, requests=5)})
    b.put("r2", 0.5, 1.0, {"m": ModelLoad(in_flight=4, waiting=2, requests=7)})
    s = b.samples(1.0, MAP)["d"]
    assert (s.in_flight, s.waiting, s.requests, s.at) == (7, 3, 12, 1.0)
    # A router's newer report replaces its own, never adds to it.
    b.put("r1", 1.0, 1.0, {"m": ModelLoad(in_flight=1)})
    assert b.samples(1.2, MAP)["d"].in_flight == 5


def test_a_router_that_goes_away_stops_counting() -> None:
    b = LoadBoard()
    b.put("r1", 0.0, 1.0, {"m": ModelLoad(in_flight=3)})
    b.put("r2", 0.0, 2.0, {"m": ModelLoad(in_flight=4)})
    assert b.samples(3.0, MAP)["d"].in_flight == 7  # three of r1's intervals: still counted
    assert b.samples(3.01, MAP)["d"].in_flight == 4  # r1 is gone; r2 (2 s) stays until 6 s
    assert list(b.reports) == ["r2"]
    assert b.samples(6.5, MAP) == {}
    assert b.reports == {}


def test_held_requests_count_as_in_flight_and_as_arrivals() -> None:
    b = LoadBoard()
    b.put("r1", 0.0, 1.0, {"m": ModelLoad(held=2), "other": ModelLoad(requests=1),
                           "unknown": ModelLoad(in_flight=9)})
    got = b.samples(0.5, MAP)
    assert (got["d"].in_flight, got["d"].requests, got["d"].active) == (2, 2, True)
    assert got["e"].requests == 1 and "unknown" not in got


def test_interval_is_the_shortest_live_one() -> None:
    b = LoadBoard()
    assert b.interval(5.0) == 5.0
    b.put("r1", 0.0, 2.0, {})
    b.put("r2", 0.0, 0.5, {})
    assert b.interval(5.0) == 0.5


@given(st.lists(st.tuples(st.sampled_from(["r1", "r2", "r3"]), st.integers(0, 50),
                          st.integers(0, 50)), max_size=20))
def test_sum_is_the_sum_of_each_routers_latest(reports: list[tuple[str, int, int]]) -> None:
    b = LoadBoard()
    latest: dict[str, tuple[int, int]] = {}
    for router, in_flight, requests in reports:
        b.put(router, 0.0, 1.0, {"m": ModelLoad(in_flight=in_flight, requests=requests)})
        latest[router] = (in_flight, requests)
    got = b.samples(0.0, MAP).get("d")
    if not latest:
        assert got is None
    else:
        assert got is not None
        assert got.in_flight == sum(v[0] for v in latest.values())
        assert got.requests == sum(v[1] for v in latest.values())


def test_a_load_report_travels_and_bad_figures_are_refused() -> None:
    op = LoadReportOp({"m": ModelLoad(1.0, 2.0, 3, 4)}, interval=0.5, wake=True)
    req = Request(1, "x", op)
    assert codec.decode(codec.encode(req)) == req
    with pytest.raises(ValueError):
        ModelLoad(in_flight=-1)
    with pytest.raises(ValueError):
        ModelLoad(waiting=float("nan"))


def _deployment(**autoscale: object) -> Deployment:
    return parse_deployment({"name": "d", "model": "m", "engine": "simulated", "gpus_per_node": 1,
                             "replicas": 1, "autoscale": {"max": 4, "in_flight_per_replica": 2,
                                                          **autoscale}}, "t")


def test_step_scales_up_after_the_window_and_waits_for_the_routers() -> None:
    a = Autoscaler()
    d = _deployment(scale_up_after="1s", scale_down_after="2s")
    ds = {"d": d}
    assert a.step(0.0, ds) == []  # no router reports: nothing decided, nothing observed
    assert a.memory == {}
    for t in (0.0, 0.5, 1.0):
        a.report("r1", t, LoadReportOp({"m": ModelLoad(in_flight=3)}, interval=0.5), ds)
        a.report("r2", t, LoadReportOp({"m": ModelLoad(in_flight=3)}, interval=0.5), ds)
        changes = a.step(t, ds)
    assert [(c.before, c.after, c.direction) for c in changes] == [(1, 3, "up")]
    assert "in flight 6" in changes[0].reason and a.desired == {"d": 3}
    # Pinned (autoscale off), then deleted: its memory and figures go.
    assert a.step(1.5, {"d": evolve(d, autoscale=None)}) == []
    assert a.memory == {} and a.desired == {} and a.last == {}
    assert a.step(2.0, {}) == []


def test_a_wake_marks_a_deployment_at_zero() -> None:
    a = Autoscaler()
    d = evolve(_deployment(min=0, idle_to_zero="3s"), replicas=0)
    a.report("r1", 0.0, LoadReportOp({"m": ModelLoad(held=1)}, interval=5, wake=True), {"d": d})
    assert a._wake == {"d"}
    changes = a.step(0.0, {"d": d}, only={"d"})
    assert [(c.before, c.after) for c in changes] == [(0, 1)]
    assert "woken from zero" in changes[0].reason


def test_served_names_maps_adapters_to_their_base() -> None:
    d = parse_deployment({"name": "d", "model": "m", "engine": "vllm", "gpus_per_node": 1,
                          "replicas": 1, "served_name": "base",
                          "adapters": [{"name": "ad", "path": "/a"}]}, "t")
    assert served_names({"d": d}) == {"base": "d", "ad": "d"}


def test_a_count_set_from_outside_starts_the_cool_down_again() -> None:
    a = Autoscaler()
    d = _deployment(scale_up_after="1s", scale_down_after="2s")
    ds = {"d": evolve(d, replicas=3)}
    for t in (0.0, 1.0, 2.0, 3.0):
        a.report("r1", t, LoadReportOp({}, interval=1.0), ds)
        changes = a.step(t, ds)
        if changes:
            break
    assert [(c.before, c.after) for c in changes] == [(3, 2)]
    # The autoscaler asked for 2; an operator pins 3 then applies: 2 s before a step down.
    for t in (4.0, 5.0, 5.9):
        a.report("r1", t, LoadReportOp({}, interval=1.0), ds)
        assert a.step(t, ds) == [], t
    a.report("r1", 6.0, LoadReportOp({}, interval=1.0), ds)
    assert [(c.before, c.after) for c in a.step(6.0, ds)] == [(3, 2)]


async def test_the_loop_decides_twice_an_interval_and_at_once_on_a_wake(
        autojump_clock: trio.testing.MockClock) -> None:
    a = Autoscaler()
    ds = {"d": evolve(_deployment(min=0, idle_to_zero="3s", scale_up_after="1s"), replicas=0)}
    applied: list[tuple[float, int, int]] = []

    async def apply(c: Change, now: float) -> bool:
        applied.append((now, c.before, c.after))
        ds[c.deployment] = evolve(ds[c.deployment], replicas=c.after)
        return True

    async with trio.open_nursery() as n:
        await n.start(a.serve, lambda: ds, apply, trio.current_time)
        a.report("r1", trio.current_time(), LoadReportOp({}, interval=1.0), ds)
        await trio.sleep(2.2)
        assert applied == []  # no load, at zero: nothing to do
        # A wake at 2.2 s: decided then, not at the next tick (2.5 s).
        a.report("r1", trio.current_time(), LoadReportOp({"m": ModelLoad(held=1)}, interval=1.0,
                                                         wake=True), ds)
        await trio.sleep(0.01)
        assert applied == [(pytest.approx(2.2), 0, 1)]
        # Load for 3 reported from 2.41 s: ticks at 2.5, 3.0 and 3.5 s see it, and at 3.5 s
        # it has lasted the whole window (1 s).
        await trio.sleep(0.2)
        for _ in range(3):
            a.report("r1", trio.current_time(), LoadReportOp({"m": ModelLoad(in_flight=5)},
                                                             interval=1.0), ds)
            await trio.sleep(0.5)
        n.cancel_scope.cancel()
    assert applied[1:] == [(pytest.approx(3.5), 1, 3)]
    assert a.decisions == {("d", "up"): 2}

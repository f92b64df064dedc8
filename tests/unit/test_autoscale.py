"""The autoscaler's decision (server/elastic/decide.py) on plain data, and a model-based test over
random load traces: never outside [min, max], no flapping on constant load, a step up
reached within scale_up_after plus one interval (issue 25)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.config.deployment import parse_deployment
from llmgw.errors import DeploymentError
from llmgw.model.autoscale import Autoscale, Target
from llmgw.server.elastic.decide import Decision, LoadSample, ScaleMemory, decide, observe

INTERVAL = 5.0


def spec(**kw: Any) -> Autoscale:
    base: dict[str, Any] = dict(min=1, max=10, target=Target.IN_FLIGHT, target_value=8.0,
                                scale_up_after=15.0, scale_down_after=60.0)
    return Autoscale(**{**base, **kw})


def run(a: Autoscale, loads: list[tuple[float, float, int]], start: int,
        t0: float = 0.0) -> list[Decision]:
    """Feed one sample per INTERVAL ((in_flight, waiting, requests) each) and decide after
    each, the count following the decisions."""
    memory, current, out = ScaleMemory(), start, []
    for i, (in_flight, waiting, requests) in enumerate(loads):
        now = t0 + i * INTERVAL
        memory = observe(a, memory, LoadSample(now, in_flight, waiting, requests))
        d = decide(a, current, memory, now)
        memory, current = d.memory, d.replicas
        out.append(d)
    return out


def counts(ds: list[Decision]) -> list[int]:
    return [d.replicas for d in ds]


def test_a_step_up_waits_out_scale_up_after_then_goes_to_the_need_at_once() -> None:
    ds = run(spec(), [(40.0, 0, 10)] * 6, start=1)
    # Samples at 0, 5, 10 cover no 15 s window yet; at 15 s they do: 40 / 8 = 5.
    assert counts(ds) == [1, 1, 1, 5, 5, 5]
    assert ds[3].reason == "scaled up 1 -> 5: in flight 40 (target 8 per replica) for 15s"


def test_a_spike_shorter_than_the_window_moves_nothing() -> None:
    loads = [(8.0, 0, 1)] * 4 + [(80.0, 0, 9), (8.0, 0, 1)] * 4
    assert set(counts(run(spec(), loads, start=1))) == {1}


def test_down_waits_for_the_window_and_the_last_change_and_at_most_halves() -> None:
    a = spec(scale_down_after=30.0)
    ds = run(a, [(80.0, 0, 10)] * 4 + [(0.0, 0, 1)] * 40, start=1)
    got = counts(ds)
    assert got[3] == 10  # up at 15 s
    first_down = got.index(5)
    assert first_down * INTERVAL >= 15.0 + 30.0  # the window of low need and the cool-down
    assert got[first_down:].count(5) >= 30.0 / INTERVAL  # halving, then waiting again
    assert got[-1] == 1 and min(got) == 1  # never below min while requests come
    assert "scaled down 10 -> 5: in flight 0 (target 8 per replica) for 30s" in ds[first_down].reason


def test_idle_to_zero_and_a_request_wakes_it_at_once() -> None:
    a = spec(min=0, idle_to_zero=60.0)
    ds = run(a, [(0.0, 0, 0)] * 14 + [(0.0, 0, 3)] + [(3.0, 0, 0)] * 2, start=1)
    got = counts(ds)
    assert got[11] == 1 and got[12] == 0  # at 55 s still up, at 60 s without a request: zero
    assert ds[12].reason == "no request for 60s (idle_to_zero 60s): to zero"
    assert got[13] == 0
    assert got[14] == 1  # the held request wakes it, no window
    assert ds[14].reason.startswith("woken from zero by requests")


def test_waiting_target_steps_up_on_the_queue_and_down_one_at_a_time_when_it_is_empty() -> None:
    a = spec(target=Target.WAITING, target_value=4.0, scale_down_after=20.0)
    got = counts(run(a, [(30.0, 20.0, 5)] * 4 + [(10.0, 0.0, 5)] * 30, start=2))
    assert got[3] == 5  # 20 waiting / 4
    assert got[-1] == 1 and all(b - a_ in (0, -1) for a_, b in zip(got[4:], got[5:], strict=False))


def test_the_count_is_brought_into_min_max() -> None:
    a = spec(min=2, max=4)
    assert decide(a, 7, observe(a, ScaleMemory(), LoadSample(0.0)), 0.0).replicas == 4
    assert decide(a, 1, observe(a, ScaleMemory(), LoadSample(0.0)), 0.0).replicas == 2
    assert decide(a, 0, ScaleMemory(), 0.0).replicas == 2


# -- the model-based test -----------------------------------------------------------------

loads_st = st.lists(st.tuples(st.floats(0, 200, allow_nan=False), st.integers(1, 12)),
                    min_size=1, max_size=6)  # (in flight, how many intervals it lasts)


@settings(max_examples=300, deadline=None)
@given(steps=loads_st, lo=st.integers(0, 3), span=st.integers(0, 6), start=st.integers(0, 12),
       up=st.sampled_from([10.0, 15.0, 30.0]), down=st.sampled_from([15.0, 60.0, 300.0]))
def test_random_traces(steps: list[tuple[float, int]], lo: int, span: int, start: int,
                       up: float, down: float) -> None:
    a = spec(min=lo, max=max(lo, 1) + span, scale_up_after=up, scale_down_after=down,
             idle_to_zero=120.0 if lo == 0 else 0.0)
    trace = [(load, 0.0, 1 if load else 0) for load, n in steps for _ in range(n)]
    # Long enough for the slowest way down: a halving per scale_down_after, then zero.
    halvings = math.ceil(math.log2(max(a.max, start, 1))) + 1
    settle = int((up + down * halvings + a.idle_to_zero) / INTERVAL) + 8
    trace += [trace[-1]] * settle  # the last load held long enough to settle
    ds = run(a, trace, start=start)
    got = counts(ds)
    # Never outside [min, max] once brought in (the first decision does that).
    assert all(a.min <= n <= a.max for n in got)
    # Constant load settles: the last stretch is one count, the need it asks for.
    tail = got[-4:]
    assert len(set(tail)) == 1, got
    load = trace[-1][0]
    want = min(a.max, max(math.ceil(load / 8.0 - 1e-9), a.min, 1 if load or not a.idle_to_zero else 0))
    assert tail[0] == want, (got, want)
    # A step up is reached within scale_up_after plus one interval.
    i = 0
    for load_i, n in steps:
        need = min(a.max, math.ceil(load_i / 8.0 - 1e-9))
        if n * INTERVAL > up + INTERVAL and i > 0 and need > got[i - 1]:
            by = i + int(up / INTERVAL) + 1
            assert got[by] >= need, (got, i, need)
        i += n


@pytest.mark.parametrize(("auto", "key", "words"), [
    ({"min": 3, "max": 2, "in_flight_per_replica": 4}, "autoscale.min", "above max"),
    ({"max": 2, "in_flight_per_replica": 0}, "autoscale.in_flight_per_replica", "above zero"),
    ({"max": 2, "in_flight_per_replica": 4, "maxx": 3}, "autoscale.maxx", "unknown field"),
    ({"max": 2}, "autoscale", "one target"),
    ({"max": 2, "in_flight_per_replica": 4, "waiting_per_replica": 1}, "autoscale", "not both"),
    ({"min": 0, "max": 2, "in_flight_per_replica": 4}, "autoscale.min", "needs idle_to_zero"),
    ({"max": 2, "in_flight_per_replica": 4, "idle_to_zero": "1m"}, "autoscale.idle_to_zero", "needs min: 0"),
    ({"max": 2, "in_flight_per_replica": 4, "scale_up_after": "0s"}, "autoscale.scale_up_after", "above zero"),
    ("yes", "autoscale", "expected a mapping"),
])
def test_bad_autoscale_sections_name_the_key(auto: Any, key: str, words: str) -> None:
    data = {"name": "a", "model": "org/m", "engine": "vllm", "gpus_per_node": 1, "replicas": 1,
            "autoscale": auto}
    with pytest.raises(DeploymentError) as info:
        parse_deployment(data, "deploy/a.yaml")
    assert info.value.key == key and words in str(info.value) and info.value.exit_code == 2


def test_autoscale_round_trips_and_bounds_the_starting_count() -> None:
    data = {"name": "a", "model": "org/m", "engine": "vllm", "gpus_per_node": 1, "replicas": 0,
            "autoscale": {"min": 0, "max": 4, "waiting_per_replica": 2, "idle_to_zero": "30m",
                          "scale_down_after": "2m"}}
    d = parse_deployment(data, "x.yaml")
    assert d.autoscale == Autoscale(0, 4, Target.WAITING, 2.0, 15.0, 120.0, 1800.0)
    assert parse_deployment(d.plain(), "again") == d
    assert d.template_hash() == parse_deployment({**data, "autoscale": None}, "x").template_hash()
    with pytest.raises(DeploymentError, match="replicas: 9 is outside autoscale's min..max"):
        parse_deployment({**data, "replicas": 9}, "x.yaml")

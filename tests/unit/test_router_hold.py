"""The router's side of autoscale (issue 25): router.toml's keys, requests held for a
model at zero (router/routing/hold.py, on trio's autojump clock) and the load report's figures
(router/routing/load_report.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from test_router_config_admission import write

from llmgw.config.load_router import load_router_config
from llmgw.errors import ConfigError
from llmgw.router.routing.hold import HoldRefused, Holds
from llmgw.router.routing.load_report import LoadCounter, report_load
from llmgw.router.routing.table import EndpointTable
from llmgw.transport.requests import LoadReportOp, ModelLoad


def test_keys_shipped_and_checked(tmp_path: Path) -> None:
    cfg = load_router_config(write(tmp_path))
    assert (cfg.load_report_interval, cfg.hold_queue, cfg.cold_start_budget) == (5.0, 256, 120.0)
    for old, new, key in [('load_report_interval = "5s"', 'load_report_interval = "10ms"',
                           "load_report_interval"),
                          ("hold_queue = 256", "hold_queue = -1", "hold_queue"),
                          ('cold_start_budget = "120s"', 'cold_start_budget = "0s"',
                           "cold_start_budget")]:
        sub = tmp_path / key
        sub.mkdir()
        with pytest.raises(ConfigError, match=key):
            load_router_config(write(sub, (old, new)))


async def test_held_requests_go_when_released(autojump_clock: trio.testing.MockClock) -> None:
    holds = Holds(size=2, budget=10.0)
    done: list[float] = []

    async def one() -> None:
        await holds.hold("m", trio.current_time())
        done.append(trio.current_time())

    async with trio.open_nursery() as n:
        n.start_soon(one)
        n.start_soon(one)
        await trio.sleep(1)
        assert holds.held("m") == 2 and holds.any
        with pytest.raises(HoldRefused, match="already wait") as full:
            await holds.hold("m", trio.current_time())
        assert full.value.why == "hold_full"
        await trio.sleep(2)
        assert holds.release("m") == 2
    assert done == [3.0, 3.0]
    assert not holds.any and holds.release("m") == 0


async def test_a_hold_past_its_budget_is_refused(autojump_clock: trio.testing.MockClock) -> None:
    holds = Holds(size=5, budget=4.0)
    t0 = trio.current_time()
    await trio.sleep(1)  # the budget counts from when the request came
    with pytest.raises(HoldRefused, match="cold-start budget") as late:
        await holds.hold("m", t0)
    assert late.value.why == "cold_start_timeout"
    assert trio.current_time() - t0 == pytest.approx(4.0)
    assert not holds.any


def _table() -> EndpointTable:
    t = EndpointTable()
    t.apply({"version": 1, "models": {
        "base": [{"replica_id": "b-0", "url": "http://127.0.0.1:9", "adapters": ["ad"]},
                 {"replica_id": "b-1", "url": "http://127.0.0.1:10"}]},
        "cold": ["zero"]})
    return t


def test_the_report_sums_replicas_counts_adapters_under_the_base_and_resets() -> None:
    t = _table()
    assert t.cold == frozenset({"zero"})
    b0, b1 = t.replicas["b-0"], t.replicas["b-1"]
    b0.outstanding, b1.outstanding = 2, 3
    b0.set_load(1, 4, 0.1, 10.0)
    b1.set_load(1, 7, 0.1, 0.0)  # stale at 10 s: left out
    c = LoadCounter()
    for m in ("base", "ad", "ad", "zero"):
        c.arrive(m)
    got = c.take(t, {"base": 1}, {"zero": 1}, 10.0, 2.0)
    assert got == {"base": ModelLoad(in_flight=6, waiting=4, requests=3),
                   "zero": ModelLoad(requests=1, held=1)}
    assert c.take(t, {}, {}, 10.0, 2.0)["base"].requests == 0


def test_wakes_are_spaced() -> None:
    c = LoadCounter()
    assert c.wake_due("m", 0.0) and not c.wake_due("m", 0.2) and c.wake_due("m", 0.6)
    assert c.wake_due("other", 0.2)


async def test_reports_every_interval_and_at_once_on_a_wake(
        autojump_clock: trio.testing.MockClock) -> None:
    sent: list[tuple[float, bool]] = []
    box = {"wake": trio.Event()}

    def make(woken: bool) -> LoadReportOp:
        if woken:
            box["wake"] = trio.Event()
        return LoadReportOp({}, interval=5.0, wake=woken)

    async def send(op: LoadReportOp) -> None:
        sent.append((trio.current_time(), op.wake))
        if len(sent) == 2:
            raise OSError("server away")  # logged, and the loop goes on

    async with trio.open_nursery() as n:
        n.start_soon(report_load, make, send, 5.0, lambda: box["wake"])
        await trio.sleep(7)
        box["wake"].set()
        await trio.sleep(9)
        n.cancel_scope.cancel()
    assert sent == [(5.0, False), (7.0, True), (10.0, False), (15.0, False)]

"""The router's load per model, reported to the server for the autoscaler (scale to zero).

Every `load_report_interval`, and at once when a model's first request is held (a wake),
the router sends a LoadReportOp: per served name its own in-flight count (summed over
the model's replicas, requests queued for a slot included), the engines' waiting counts
that the load watch reads (fresh figures only), the requests that arrived since the last
report (held ones included) and the requests held for a cold model. A LoRA adapter's
requests count under its base (they run on the same replicas).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping

import trio

from llmgw.router.routing.table import EndpointTable
from llmgw.transport.requests import MAX_REPORTED_MODELS, LoadReportOp, ModelLoad

log = logging.getLogger("llmgw.router.load")

WAKE_GAP = 0.5  # seconds: a model's wakes are sent at most this often


class LoadCounter:
    """Requests that arrived per model since the last report. Pure: time passed in."""

    def __init__(self) -> None:
        self.arrived: Counter[str] = Counter()
        self._woken: dict[str, float] = {}

    def arrive(self, model: str) -> None:
        if model in self.arrived or len(self.arrived) < MAX_REPORTED_MODELS:
            self.arrived[model] += 1

    def wake_due(self, model: str, now: float) -> bool:
        """Whether to send a wake for `model` now (not within WAKE_GAP of the last)."""
        if now - self._woken.get(model, -1e18) < WAKE_GAP:
            return False
        self._woken[model] = now
        if len(self._woken) > MAX_REPORTED_MODELS:
            self._woken = {m: t for m, t in self._woken.items() if now - t < WAKE_GAP}
        return True

    def take(self, table: EndpointTable, queued: Mapping[str, int], held: Mapping[str, int],
             now: float, stale_after: float) -> dict[str, ModelLoad]:
        """The report's figures; the arrival counts start again from zero."""
        names = [n for n in table.pools if n not in table.bases]
        names += [n for n in (*table.cold, *self.arrived, *held) if n not in table.bases]
        out: dict[str, ModelLoad] = {}
        for name in dict.fromkeys(names):
            if len(out) >= MAX_REPORTED_MODELS:
                break
            pool = table.pools.get(name)
            replicas = pool.replicas if pool is not None else []
            in_flight = sum(r.outstanding for r in replicas) + queued.get(name, 0)
            waiting = sum(r.waiting for r in replicas if now - r.load_at <= stale_after)
            requests = self.arrived.get(name, 0)
            # Requests for an adapter ran on its base's replicas: counted there.
            requests += sum(n for a, n in self.arrived.items() if table.bases.get(a) == name)
            out[name] = ModelLoad(in_flight=float(in_flight), waiting=float(max(waiting, 0.0)),
                                  requests=requests, held=held.get(name, 0))
        self.arrived.clear()
        return out


async def report_load(
    make: Callable[[bool], LoadReportOp],
    send: Callable[[LoadReportOp], Awaitable[object]],
    interval: float,
    wake: trio.Event | Callable[[], trio.Event],
) -> None:
    """Every `interval`, or at once when `wake()` (the current wake event) is set, send
    `make(woken)`. A failed send is logged once until one goes through again."""
    failing = False
    next_at = trio.current_time() + interval
    while True:
        event = wake() if callable(wake) else wake
        with trio.move_on_at(next_at):
            await event.wait()
        woken = event.is_set()
        if not woken:
            next_at = trio.current_time() + interval
        try:
            await send(make(woken))
        except Exception as exc:  # the server away, or one from before autoscale: keep serving
            if not failing:
                log.warning("cannot report load to the server (%s); trying again every %gs",
                            exc, interval)
            failing = True
        else:
            if failing:
                log.info("load reports reach the server again")
            failing = False

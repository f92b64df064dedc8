"""The routers' load reports, summed per deployment (elastic deployments). Pure: reports and times in,
LoadSamples out; no clock (the caller says when a report arrived and what time it is).

Each router's latest report is kept, by the router's identity (its key's name: a router
that reconnects replaces its own report, never adds a second). A report older than
STALE_REPORTS of its own intervals is dropped: a router that went away stops counting.
Per deployment the routers' figures are summed (two routers each with 3 in flight are 6,
not 3 and not 12); a served name maps to its deployment, a LoRA adapter's name to its base's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from attrs import frozen

from llmgw.server.elastic.decide import LoadSample
from llmgw.transport.requests import ModelLoad

STALE_REPORTS = 3.0  # a report older than this many of its router's intervals is dropped
MIN_INTERVAL = 0.1  # seconds: what a report's interval counts as, at least (router.toml's floor)
MAX_ROUTERS = 10_000  # reports kept at most (one per router key)


@frozen
class Report:
    at: float  # when the server received it
    interval: float  # the router's report interval
    models: Mapping[str, ModelLoad]


class LoadBoard:
    def __init__(self) -> None:
        self.reports: dict[str, Report] = {}

    def put(self, router: str, at: float, interval: float, models: Mapping[str, ModelLoad]) -> None:
        if router not in self.reports and len(self.reports) >= MAX_ROUTERS:
            self.expire(at)
            if len(self.reports) >= MAX_ROUTERS:
                return  # bounded: a router key issued beyond this many is not counted
        self.reports[router] = Report(at, max(interval, MIN_INTERVAL), dict(models))

    def expire(self, now: float) -> list[str]:
        """Drop the reports that are too old; returns the routers dropped."""
        gone = [name for name, r in self.reports.items()
                if now - r.at > STALE_REPORTS * r.interval]
        for name in gone:
            del self.reports[name]
        return gone

    def interval(self, default: float) -> float:
        """How often to decide: the shortest interval the live routers report at."""
        return min((r.interval for r in self.reports.values()), default=default)

    def samples(self, now: float, deployment_of: Mapping[str, str]) -> dict[str, LoadSample]:
        """Per deployment, the live routers' figures summed, as a sample taken at `now`.
        `deployment_of`: served name (or adapter name) -> deployment; other names are
        left out (a router's table may lag behind a delete)."""
        self.expire(now)
        return sum_reports(self.reports.values(), now, deployment_of)


def sum_reports(reports: Iterable[Report], now: float,
                deployment_of: Mapping[str, str]) -> dict[str, LoadSample]:
    totals: dict[str, list[float]] = {}
    for report in reports:
        for name, load in report.models.items():
            deployment = deployment_of.get(name)
            if deployment is None:
                continue
            t = totals.setdefault(deployment, [0.0, 0.0, 0.0])
            t[0] += load.in_flight + load.held
            t[1] += load.waiting
            t[2] += load.requests + load.held
    return {d: LoadSample(at=now, in_flight=t[0], waiting=t[1], requests=int(t[2]))
            for d, t in totals.items()}

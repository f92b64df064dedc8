"""The router's own Prometheus metrics, in a registry per router (tests run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST.encode()


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter(
            "llmgw_router_requests",
            "Requests answered, by model and HTTP status.",
            ["model", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "llmgw_router_request_seconds",
            "Time from request to the end of the response (streams: to the last event).",
            ["model"],
            registry=r,
            buckets=(0.005, 0.025, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.first_byte = Histogram(
            "llmgw_router_first_byte_seconds",
            "Time from request to the engine's response head.",
            ["model"],
            registry=r,
            buckets=(0.005, 0.025, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.upstream_errors = Counter(
            "llmgw_router_upstream_errors",
            "Engine failures, by replica and kind (connect, status, timeout, broken).",
            ["replica", "kind"],
            registry=r,
        )
        self.in_flight = Gauge("llmgw_router_in_flight", "Requests being served now.", registry=r)
        self.ejections = Counter(
            "llmgw_router_ejections", "Replicas ejected after a failure.", ["replica"], registry=r
        )
        self._req_children: dict[tuple[str, int], Counter] = {}
        self._lat_children: dict[str, tuple[Histogram, Histogram]] = {}

    def count(self, model: str, status: int) -> None:
        key = (model, status)
        c = self._req_children.get(key)
        if c is None:
            if len(self._req_children) > 10_000:  # bounded: garbage model names
                model = "other"
            c = self._req_children[key] = self.requests.labels(model, str(status))
        c.inc()

    def timers(self, model: str) -> tuple[Histogram, Histogram]:
        t = self._lat_children.get(model)
        if t is None:
            t = self._lat_children[model] = (
                self.latency.labels(model),
                self.first_byte.labels(model),
            )
        return t

    def render(self) -> bytes:
        return generate_latest(self.registry)

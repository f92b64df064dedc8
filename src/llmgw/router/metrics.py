"""The router's own Prometheus metrics, in a registry per router (tests run several).

The per-request figures (requests by model and status, in-flight, the two latency
histograms) are plain Python counters and lists, turned into metric families by a
collector when /metrics is read: prometheus-client's Counter.inc / Histogram.observe take
a lock and walk every bucket on each call, which was a measurable share of the router's
CPU per request. Rare events (engine errors, ejections) use prometheus-client's Counter.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST.encode()

LATENCY_BUCKETS = (0.005, 0.025, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
FIRST_BYTE_BUCKETS = (0.005, 0.025, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60)
QUEUE_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
MAX_SERIES = 10_000  # bounded: garbage model names go to "other"


class _Hist:
    """One histogram's series by model: non-cumulative bucket counts and the sum."""

    __slots__ = ("bounds", "series", "labels")

    def __init__(self, bounds: tuple[float, ...], labels: tuple[str, ...] = ("model",)) -> None:
        self.bounds = bounds
        self.labels = labels
        # model (or a tuple, one value per label) → [count per bucket..., +Inf, sum]
        self.series: dict[str | tuple[str, ...], list[float]] = {}

    def observe(self, model: str | tuple[str, ...], v: float) -> None:
        s = self.series.get(model)
        if s is None:
            if len(self.series) >= MAX_SERIES:
                model = "other" if isinstance(model, str) else ("other",) * len(model)
            s = self.series.setdefault(model, [0.0] * (len(self.bounds) + 2))
        s[bisect_left(self.bounds, v)] += 1
        s[-1] += v

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=list(self.labels))
        for model, s in sorted(self.series.items(), key=lambda kv: str(kv[0])):
            acc = 0.0
            buckets = []
            for le, n in zip((*map(str, self.bounds), "+Inf"), s[:-1], strict=True):
                acc += n
                buckets.append((le, acc))
            fam.add_metric([model] if isinstance(model, str) else list(model), buckets, s[-1])
        return fam


class _Collector:
    def __init__(self, m: RouterMetrics) -> None:
        self.m = m

    def collect(self) -> Iterator[Metric]:
        m = self.m
        req = CounterMetricFamily(
            "llmgw_router_requests",
            "Requests answered, by model and HTTP status.",
            labels=["model", "status"],
        )
        for (model, status), n in sorted(m.requests.items()):
            req.add_metric([model, str(status)], n)
        yield req
        yield m.latency.family(
            "llmgw_router_request_seconds",
            "Time from request to the end of the response (streams: to the last event).",
        )
        yield m.first_byte_hist.family(
            "llmgw_router_first_byte_seconds", "Time from request to the engine's response head."
        )
        yield GaugeMetricFamily("llmgw_router_in_flight", "Requests being served now.", value=m.in_flight)
        yield CounterMetricFamily(
            "llmgw_router_handler_errors",
            "Client connections ended by an unexpected error in the router (a bug; see the log).",
            value=m.handler_errors,
        )
        queue = GaugeMetricFamily(
            "llmgw_router_queue_length", "Requests waiting for an engine slot, by model.", labels=["model"]
        )
        for model, n in sorted(m.queues().items()):
            queue.add_metric([model], n)
        yield queue
        refused = CounterMetricFamily(
            "llmgw_router_refused",
            "Requests refused with 503 server_overloaded, by model and why (queue_full, queue_timeout).",
            labels=["model", "why"],
        )
        for (model, why), n in sorted(m.refused.items()):
            refused.add_metric([model, why], n)
        yield refused
        waiting = GaugeMetricFamily("llmgw_router_queue_waiting",
                                    "Requests waiting for an engine slot, by model and priority class.",
                                    labels=["model", "class"])
        for (model, band), n in sorted(m.bands().items()):
            waiting.add_metric([model, band], n)
        yield waiting
        yield m.queue_wait.family(
            "llmgw_router_queue_wait_seconds",
            "Time from joining a model's queue to an engine slot, by priority class (0 for a "
            "request that found a slot free); requests shed are not in it.")
        shed = CounterMetricFamily(
            "llmgw_router_queue_shed",
            "Requests refused by a model's queue with 503 server_overloaded, by priority class and "
            "why (queue_full, queue_timeout, displaced: by a request of a higher class).",
            labels=["model", "class", "why"])
        for (model, band, why), n in sorted(m.shed.items()):
            shed.add_metric([model, band, why], n)
        yield shed
        yield GaugeMetricFamily(
            "llmgw_router_loop_lag_seconds",
            "The router loop's worst lateness (a timer's wake-up past its due time) since the last scrape.",
            value=m.loop_lag(),
        )
        yield CounterMetricFamily(
            "llmgw_router_loop_late_seconds",
            "Seconds the router loop ran late in all (wake-ups past their due time, summed).",
            value=m.loop_late_total(),
        )
        yield CounterMetricFamily(
            "llmgw_router_connects_forgiven",
            "Engine connects whose deadline passed while the router itself was late, and that were "
            "given that time back instead of being counted against the engine.",
            value=m.forgiven(),
        )
        yield from m.tenants()  # API keys, usage and limits (router/tenants/metrics.py)
        yield from m.kv()  # kv_aware routing (router/kv/policy.py)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests: dict[tuple[str, int], int] = {}
        self.in_flight = 0
        self.handler_errors = 0
        self.latency = _Hist(LATENCY_BUCKETS)
        self.first_byte_hist = _Hist(FIRST_BYTE_BUCKETS)
        self.refused: dict[tuple[str, str], int] = {}
        # The fair queue, by model and priority class (both bounded: the table's models,
        # the configured classes).
        self.queue_wait = _Hist(QUEUE_BUCKETS, ("model", "class"))
        self.shed: dict[tuple[str, str, str], int] = {}
        # Set by the router: figures read when /metrics is rendered.
        self.queues: Callable[[], dict[str, int]] = dict
        self.bands: Callable[[], dict[tuple[str, str], int]] = dict
        self.loop_lag: Callable[[], float] = float
        self.loop_late_total: Callable[[], float] = float
        self.forgiven: Callable[[], int] = int
        self.tenants: Callable[[], Iterator[Metric]] = lambda: iter(())
        self.kv: Callable[[], Iterator[Metric]] = lambda: iter(())
        r.register(_Collector(self))
        self.upstream_errors = Counter(
            "llmgw_router_upstream_errors",
            "Engine failures, by replica and kind (connect, status, timeout, broken).",
            ["replica", "kind"],
            registry=r,
        )
        self.ejections = Counter(
            "llmgw_router_ejections", "Replicas ejected after a failure.", ["replica"], registry=r
        )
        self.failovers = Counter(
            "llmgw_router_stream_failovers",
            "Streams whose engine failed mid-answer, by model and outcome (resumed: another "
            "replica went on; refused: the request or what was sent cannot be resumed, or no "
            "migration was left; failed: no replica went on in time; whole: only the end was "
            "lost).",
            ["model", "outcome"],
            registry=r,
        )

    def count(self, model: str, status: int) -> None:
        key = (model, status)
        n = self.requests.get(key)
        if n is None:
            if len(self.requests) >= MAX_SERIES:
                key = ("other", status)
            n = self.requests.get(key, 0)
        self.requests[key] = n + 1

    def done(self, model: str, status: int, seconds: float) -> None:
        """One request answered: counted, and its latency observed when the model is known."""
        self.count(model, status)
        if model:
            self.latency.observe(model, seconds)

    def refuse(self, model: str, why: str) -> None:
        key = (model, why)
        self.refused[key] = self.refused.get(key, 0) + 1  # models are the table's: bounded

    def shed_one(self, model: str, band: str, why: str) -> None:
        key = (model, band, why)
        self.shed[key] = self.shed.get(key, 0) + 1

    def first_byte(self, model: str, seconds: float) -> None:
        self.first_byte_hist.observe(model, seconds)

    def failover(self, model: str, outcome: str) -> None:
        self.failovers.labels(model, outcome).inc()  # models are the table's: bounded

    def upstream_error(self, replica: str, kind: str) -> None:
        self.upstream_errors.labels(replica, kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""The agent's Prometheus metrics and its /metrics listener, in a registry per agent.

Engines and GPUs are read when /metrics is scraped (a collector over the supervisor's
reports and an NVML sample taken for that scrape); durations are histograms observed
where the work happens (a health probe, a discovery run).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

import trio
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.process_collector import ProcessCollector

from llmgw import __version__
from llmgw.agent.gpus.usage import GpuSampler, GpuUsage
from llmgw.http1.listen import HttpRequest, Response, Route
from llmgw.http1.serve import serve_http
from llmgw.model.engine import EngineReport, EngineState
from llmgw.model.inventory import Inventory

MIB = 1024 * 1024
PROBE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
DISCOVERY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
SAMPLE_TIMEOUT = 5.0  # seconds an NVML read may take before the scrape goes on without it


class AgentMetrics:
    def __init__(self, node_id: str, reports: Callable[[], tuple[EngineReport, ...]],
                 counts: Callable[[], tuple[int, int]], inventory: Callable[[], Inventory],
                 sampler: GpuSampler) -> None:
        self.node_id = node_id
        self.reports = reports
        self.counts = counts  # (engine starts, restarts)
        self.inventory = inventory
        self.sampler = sampler
        self.usage: list[GpuUsage] | None = None  # the latest NVML sample, None: none
        self.discovery_failures = 0
        self._nvml = trio.CapacityLimiter(1)
        self.registry = CollectorRegistry(auto_describe=True)
        self.health_probe = Histogram(
            "llmgw_agent_health_probe_duration_seconds",
            "Time of each engine health probe (GET /health), by whether it answered 200",
            ["result"], buckets=PROBE_BUCKETS, registry=self.registry)
        self.discovery = Histogram(
            "llmgw_agent_discovery_duration_seconds",
            "Time of each discovery run (GPUs, fabrics, storage, engines)",
            buckets=DISCOVERY_BUCKETS, registry=self.registry)
        self.registry.register(_Collector(self))
        ProcessCollector(registry=self.registry)

    def probed(self, seconds: float, ok: bool) -> None:
        self.health_probe.labels("ok" if ok else "failed").observe(seconds)

    async def refresh_gpus(self) -> None:
        """Take an NVML sample for this scrape (in a thread; at most one at a time)."""
        self.usage = None
        with trio.move_on_after(SAMPLE_TIMEOUT):
            self.usage = await trio.to_thread.run_sync(self.sampler.sample, limiter=self._nvml,
                                                       abandon_on_cancel=True)

    def routes(self) -> dict[str, Route]:
        async def get_metrics(req: HttpRequest) -> Response:
            await self.refresh_gpus()
            return Response(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)

        return {"/metrics": Route(get_metrics)}

    async def serve(self, bind: str, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        await serve_http(bind, self.routes(), name="agent metrics", task_status=task_status)


def _gpu_rows(usage: list[GpuUsage] | None, inventory: Inventory) -> list[GpuUsage]:
    """NVML's sample where there is one; else what the last discovery saw (memory only)."""
    if usage is not None:
        return usage
    return [GpuUsage(g.index, g.uuid, (g.memory_total - g.memory_free) * MIB, g.memory_total * MIB, None)
            for g in inventory.gpus]


class _Collector:
    def __init__(self, m: AgentMetrics) -> None:
        self.m = m

    def describe(self) -> Iterator[Metric]:
        return self._families(live=False)

    def collect(self) -> Iterator[Metric]:
        return self._families(live=True)

    def _families(self, live: bool) -> Iterator[Metric]:
        m = self.m
        info = GaugeMetricFamily("llmgw_agent_info", "Always 1; the llmgw version and this node's id",
                                 labels=["version", "node"])
        engines = GaugeMetricFamily("llmgw_agent_engines",
                                    "Engines on this node by state (exited: the latest of each replica)",
                                    labels=["state"])
        starts = CounterMetricFamily("llmgw_agent_engine_starts", "Engine processes started")
        restarts = CounterMetricFamily("llmgw_agent_engine_restarts",
                                       "Engines started again for a replica that ran here before")
        failures = CounterMetricFamily("llmgw_agent_discovery_failures",
                                       "Periodic discovery runs that failed (the last inventory kept)")
        gpus = GaugeMetricFamily("llmgw_agent_gpus", "GPUs this node reports")
        nvml_up = GaugeMetricFamily("llmgw_agent_gpu_nvml_up",
                                    "1 when NVML answered this scrape (per-GPU figures are live), else 0")
        labels = ["gpu", "uuid"]
        used = GaugeMetricFamily("llmgw_agent_gpu_memory_used_bytes", "GPU memory in use", labels=labels)
        total = GaugeMetricFamily("llmgw_agent_gpu_memory_total_bytes", "GPU memory", labels=labels)
        util = GaugeMetricFamily("llmgw_agent_gpu_utilization_ratio",
                                 "Share of NVML's last sample period a kernel ran (0 to 1)", labels=labels)
        if live:
            info.add_metric([__version__, m.node_id], 1)
            by_state = Counter(r.state for r in m.reports())
            for state in EngineState:
                engines.add_metric([str(state)], by_state.get(state, 0))
            n_starts, n_restarts = m.counts()
            starts.add_metric([], n_starts)
            restarts.add_metric([], n_restarts)
            failures.add_metric([], m.discovery_failures)
            inv = m.inventory()
            gpus.add_metric([], len(inv.gpus))
            nvml_up.add_metric([], 0 if m.usage is None else 1)
            for g in _gpu_rows(m.usage, inv):
                key = [str(g.index), g.uuid]
                used.add_metric(key, g.memory_used)
                total.add_metric(key, g.memory_total)
                if g.utilization is not None:
                    util.add_metric(key, g.utilization)
        yield from (info, engines, starts, restarts, failures, gpus, nvml_up, used, total, util)

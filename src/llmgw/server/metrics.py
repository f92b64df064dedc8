"""The server's Prometheus metrics, in a registry of its own (tests run several servers).

What the server knows anyway (nodes, replicas, message and refusal counts kept by the
control plane) is read when /metrics is scraped, by a collector: no gauge is kept up to
date beside the state it describes. Durations are prometheus-client histograms, observed
where the work happens (a reconcile pass, a store write).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector

from llmgw import __version__
from llmgw.model.deployment import Replica, ReplicaState
from llmgw.model.inventory import Inventory
from llmgw.model.node import NodeState
from llmgw.server.status import GPU_STATES, gpu_state, preflight_by_fabric
from llmgw.server.tenants.usage_metrics import usage_families

if TYPE_CHECKING:
    from llmgw.server.orchestrator import Orchestrator

T = TypeVar("T")

# Seconds. A steady pass takes well under a millisecond; placing at 50,000 nodes about one.
PASS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

# Store methods that write (timed by TimedStore); every other attribute passes through.
STORE_WRITES = frozenset({
    "put_deployment", "delete_deployment", "save_replicas", "put_node", "put_nodes",
    "set_cordoned", "delete_node", "add_events", "trim_events",
})


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.reconcile_pass = Histogram(
            "llmgw_server_reconcile_pass_duration_seconds",
            "Wall time of each reconcile pass (adoption, reconcile and placement; not the store write)",
            buckets=PASS_BUCKETS, registry=self.registry)
        self.placement = Histogram(
            "llmgw_server_placement_duration_seconds",
            "Wall time of each reconcile pass that placed (or restarted) at least one replica",
            buckets=PASS_BUCKETS, registry=self.registry)
        self.store_write = Histogram(
            "llmgw_server_store_write_duration_seconds",
            "Time of each write to the state store, by operation",
            ["op"], buckets=STORE_BUCKETS, registry=self.registry)
        self.zap_denials: Counter[str] = Counter()
        self.placed = 0
        self.orchestrator: Orchestrator | None = None
        self.sent: Callable[[], Counter[str]] = Counter
        self.send_dropped: Callable[[], int] = lambda: 0
        # Node id -> (the inventory last counted, its GPUs by state): a scrape recounts
        # only the nodes whose inventory object changed.
        self.gpu_counts: dict[str, tuple[Inventory, Counter[str]]] = {}
        self.registry.register(_Collector(self))
        ProcessCollector(registry=self.registry)

    def watch(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator
        orchestrator.on_pass = self.pass_done

    def pass_done(self, seconds: float, before: dict[str, Replica], after: dict[str, Replica]) -> None:
        self.reconcile_pass.observe(seconds)
        placed = placed_count(before, after)
        if placed:
            self.placed += placed
            self.placement.observe(seconds)

    def gpus_by_state(self, o: Orchestrator) -> Counter[str]:
        """GPUs on nodes not lost, by gpu_state (unhealthy, degraded, releasing, held, healthy)."""
        total: Counter[str] = Counter()
        seen = self.gpu_counts
        live = set()
        for nid, n in o.cp.nodes.items():
            if n.state == NodeState.LOST:
                continue
            live.add(nid)
            hit = seen.get(nid)
            if hit is None or hit[0] is not n.inventory:
                hit = seen[nid] = (n.inventory, Counter(gpu_state(g) for g in n.inventory.gpus))
            total.update(hit[1])
        for nid in [nid for nid in seen if nid not in live]:
            del seen[nid]
        return total

    def zap_denied(self, reason: str) -> None:
        self.zap_denials[reason] += 1

    def timed(self, store: T) -> T:
        """`store` with the time of each write observed (whatever the store's backend)."""
        return cast(T, TimedStore(store, self.store_write.labels))


def placed_count(before: dict[str, Replica], after: dict[str, Replica]) -> int:
    """Replicas a pass put on nodes with a new generation: placed, placed again, or
    restarted in place."""
    n = 0
    for rid, r in after.items():
        if not r.members:
            continue
        old = before.get(rid)
        if old is None or old.generation != r.generation or not old.members:
            n += 1
    return n


class TimedStore:
    """The store, with each write's duration observed (in the thread that runs it)."""

    def __init__(self, store: Any, timer: Callable[[str], Histogram]) -> None:
        self._store = store
        self._timer = timer

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name not in STORE_WRITES:
            return attr
        hist = self._timer(name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                hist.observe(time.perf_counter() - started)

        return timed


class _Collector:
    def __init__(self, m: ServerMetrics) -> None:
        self.m = m

    def describe(self) -> Iterator[Metric]:
        # Descriptions only (no state read): what the registry checks names against.
        return self._families(None, live=False)

    def collect(self) -> Iterator[Metric]:
        return self._families(self.m.orchestrator, live=True)

    def _families(self, o: Orchestrator | None, live: bool) -> Iterator[Metric]:
        info = GaugeMetricFamily("llmgw_server_info", "Always 1; the llmgw version", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        nodes = GaugeMetricFamily("llmgw_server_nodes", "Nodes known to the server, by state",
                                  labels=["state"])
        cordoned = GaugeMetricFamily("llmgw_server_nodes_cordoned",
                                     "Nodes cordoned (placement puts nothing new there), draining or not")
        draining = GaugeMetricFamily("llmgw_server_nodes_draining",
                                     "Nodes being drained (their replicas move away)")
        connected = GaugeMetricFamily("llmgw_server_nodes_connected", "Nodes with a live session")
        replicas = GaugeMetricFamily("llmgw_server_replicas", "Replicas by deployment and state",
                                     labels=["deployment", "state"])
        desired = GaugeMetricFamily("llmgw_server_deployment_replicas_desired",
                                    "Replicas each deployment asks for", labels=["deployment"])
        unschedulable = GaugeMetricFamily("llmgw_server_replicas_unschedulable",
                                          "Replicas waiting for room (pending, with a reason)")
        gpus = GaugeMetricFamily(
            "llmgw_server_gpus",
            "GPUs on nodes not lost, by state: unhealthy (a hard problem: never placed, replicas "
            "move off), degraded (a soft problem: no new replica, what runs stays), releasing "
            "(an engine's memory not back), held (other processes on it), healthy",
            labels=["state"])
        holding = GaugeMetricFamily("llmgw_server_mass_loss_hold",
                                    "1 while the mass-loss guard holds re-placement, else 0")
        received = CounterMetricFamily("llmgw_server_messages_received",
                                       "Messages received from peers, by kind", labels=["kind"])
        sent = CounterMetricFamily("llmgw_server_messages_sent", "Messages sent to peers, by kind",
                                   labels=["kind"])
        send_dropped = CounterMetricFamily("llmgw_server_messages_send_dropped",
                                           "Messages not sent: the peer was gone or its queue full")
        refusals = CounterMetricFamily("llmgw_server_refusals",
                                       "Messages and requests refused or dropped, by reason",
                                       labels=["reason"])
        zap = CounterMetricFamily("llmgw_server_zap_denials",
                                  "CURVE handshakes the ZAP handler refused, by reason", labels=["reason"])
        failures = CounterMetricFamily("llmgw_server_handler_failures",
                                       "Messages, ticks or requests whose handling raised (a bug)")
        failed_passes = CounterMetricFamily("llmgw_server_reconcile_failures",
                                            "Reconcile passes that raised (nothing changed; retried)")
        placed = CounterMetricFamily("llmgw_server_replicas_placed",
                                     "Replicas put on nodes with a new generation")
        decisions = CounterMetricFamily("llmgw_server_autoscale_decisions",
                                        "Replica counts the autoscaler changed, by deployment and "
                                        "direction (up, down)", labels=["deployment", "direction"])
        auto_desired = GaugeMetricFamily("llmgw_server_autoscale_desired_replicas",
                                         "The count the autoscaler's last decision asked for, per "
                                         "deployment with autoscale", labels=["deployment"])
        auto_load = GaugeMetricFamily("llmgw_server_autoscale_load",
                                      "The routers' summed load the autoscaler last decided on, per "
                                      "deployment with autoscale (in_flight counts held requests)",
                                      labels=["deployment", "what"])
        preemptions = CounterMetricFamily("llmgw_server_preemptions",
                                          "Replicas a deployment gave up for one of higher priority "
                                          "that lacked GPUs")
        auto_routers = GaugeMetricFamily("llmgw_server_autoscale_routers",
                                         "Routers whose load report is fresh (counted in the sums)")
        preflight = GaugeMetricFamily(
            "llmgw_server_preflight_busbw_gbps",
            "Bus bandwidth (GB/s, at the probe's largest size, the slowest member's) of the last "
            "replica placed on each fabric whose members all passed the pre-flight", labels=["fabric"])
        if o is not None:
            cp = o.cp
            a = o.autoscaler
            for name, sample in sorted(a.last.items()):
                auto_load.add_metric([name, "in_flight"], sample.in_flight)
                auto_load.add_metric([name, "waiting"], sample.waiting)
                auto_load.add_metric([name, "requests"], sample.requests)
            auto_routers.add_metric([], len(a.board.reports))
            preemptions.add_metric([], a.preemptions)
            for (name, direction), n in sorted(a.decisions.items()):
                decisions.add_metric([name, direction], n)
            for name, n in sorted(a.desired.items()):
                auto_desired.add_metric([name], n)
            by_state = Counter(n.state for n in cp.nodes.values())
            for node_state in NodeState:
                nodes.add_metric([str(node_state)], by_state.get(node_state, 0))
            cordoned.add_metric([], sum(n.cordoned for n in cp.nodes.values()))
            draining.add_metric([], sum(n.draining for n in cp.nodes.values()))
            connected.add_metric([], sum(n.connected for n in cp.nodes.values()))
            per: dict[str, Counter[ReplicaState]] = {name: Counter() for name in o.deployments}
            for r in o.replicas.values():
                per.setdefault(r.deployment, Counter())[r.state] += 1
            for name in sorted(per):
                for state in ReplicaState:
                    replicas.add_metric([name, str(state)], per[name].get(state, 0))
            for name, d in sorted(o.deployments.items()):
                desired.add_metric([name], d.replicas)
            by_gpu = self.m.gpus_by_state(o)
            for gs in GPU_STATES:
                gpus.add_metric([gs], by_gpu.get(gs, 0))
            unschedulable.add_metric([], len(o.pending))
            holding.add_metric([], 1 if o.holding else 0)
            for kind, n in sorted(cp.received.items()):
                received.add_metric([kind], n)
            for reason, n in sorted(cp.refusals.items()):
                refusals.add_metric([reason], n)
            failures.add_metric([], cp.failed)
            failed_passes.add_metric([], o.failed_passes)
            for fabric, fig in preflight_by_fabric(o).items():
                preflight.add_metric([fabric], fig["busbw_gbps"])
        if live:
            for kind, n in sorted(self.m.sent().items()):
                sent.add_metric([kind], n)
            send_dropped.add_metric([], self.m.send_dropped())
            for reason, n in sorted(self.m.zap_denials.items()):
                zap.add_metric([reason], n)
            placed.add_metric([], self.m.placed)
        yield from (nodes, cordoned, draining, connected, gpus, replicas, desired, unschedulable, holding,
                    received, sent, send_dropped, refusals, zap, failures, failed_passes, placed,
                    decisions, auto_desired, auto_load, auto_routers, preemptions, preflight)
        # Usage per API key × model and lease asks (API keys and limits): server/tenants/usage_metrics.py.
        # (getattr: the orchestrator stand-ins of the metrics tests carry no key store.)
        keys = getattr(o, "apikeys", None)
        yield from usage_families(keys.usage_totals if keys else None,
                                  keys.limits.granted if keys else 0, keys.limits.refused if keys else 0)

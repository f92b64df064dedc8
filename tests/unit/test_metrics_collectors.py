"""The server's and the agent's collectors: what a scrape says of a given state, read from
that state (no gauge kept beside it); NVML use over the fake NVML."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fakes.nvidia_smi import BUSES, FakeNvml, FakeNVMLError
from llmgw.agent.gpus.usage import RETRY, GpuSampler, read_usage
from llmgw.agent.metrics import AgentMetrics
from llmgw.config.server import ServerConfig
from llmgw.model.deployment import Deployment, Member, Replica, ReplicaState
from llmgw.model.engine import EngineKind, EngineReport, EngineState
from llmgw.model.inventory import Gpu, Inventory, NodeInfo
from llmgw.model.node import NodeState
from llmgw.server.elastic.autoscaler import Autoscaler
from llmgw.server.metrics import STORE_WRITES, ServerMetrics, TimedStore, placed_count
from llmgw.server.peers.sessions import ControlPlane, Node

GIB = 1024**3


def scrape(registry: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def at(samples: dict[Any, float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def dep(name: str, replicas: int) -> Deployment:
    return Deployment(name, f"org/{name}", EngineKind.SIMULATED, 1, replicas)


def rep(d: Deployment, i: int, state: ReplicaState, gen: int = 1, placed: bool = True) -> Replica:
    members = (Member("n1", 0, ("GPU-0",), 20000),) if placed else ()
    return Replica(f"{d.name}-{i}", d.name, i, d, generation=gen, members=members, state=state)


def node(node_id: str, state: NodeState, **kw: Any) -> Node:
    return Node(node_id, NodeInfo(node_id, "10.0.0.1"), Inventory(), state, 0.0, b"", **kw)


def test_server_collector_reads_the_state() -> None:
    cp = ControlPlane(config=ServerConfig())
    for n in (node("n1", NodeState.READY), node("n2", NodeState.READY, cordoned=True),
              node("n3", NodeState.SUSPECT, draining=True, cordoned=True),
              node("n4", NodeState.LOST, connected=False)):
        cp.seed(n)
    cp.received.update({"heartbeat": 40, "hello": 4})
    cp.refusals.update({"unauthorized_key": 2})
    cp.failed = 1
    a, b = dep("a", 2), dep("b", 1)
    o = SimpleNamespace(cp=cp, deployments={"a": a, "b": b},
                        replicas={"a-0": rep(a, 0, ReplicaState.READY), "a-1": rep(a, 1, ReplicaState.STARTING),
                                  "b-0": rep(b, 0, ReplicaState.PENDING, placed=False),
                                  # Deleted, still draining its requests: counted as such.
                                  "g-0": rep(dep("g", 1), 0, ReplicaState.DRAINING)},
                        pending={"b-0": "no room"}, holding="", failed_passes=3, on_pass=None,
                        autoscaler=Autoscaler())
    m = ServerMetrics()
    m.watch(o)  # type: ignore[arg-type]
    m.zap_denied("unknown key")
    s = scrape(m.registry)
    assert [at(s, "llmgw_server_nodes", state=x) for x in ("ready", "suspect", "lost")] == [2, 1, 1]
    assert at(s, "llmgw_server_nodes_cordoned") == 2
    assert at(s, "llmgw_server_nodes_draining") == 1
    assert at(s, "llmgw_server_nodes_connected") == 3
    assert at(s, "llmgw_server_replicas", deployment="a", state="ready") == 1
    assert at(s, "llmgw_server_replicas", deployment="a", state="starting") == 1
    assert at(s, "llmgw_server_replicas", deployment="a", state="pending") == 0  # zero, not absent
    assert at(s, "llmgw_server_replicas", deployment="b", state="pending") == 1
    assert at(s, "llmgw_server_replicas", deployment="g", state="draining") == 1
    assert at(s, "llmgw_server_replicas", deployment="a", state="draining") == 0
    assert at(s, "llmgw_server_deployment_replicas_desired", deployment="a") == 2
    assert at(s, "llmgw_server_replicas_unschedulable") == 1
    assert at(s, "llmgw_server_mass_loss_hold") == 0
    assert at(s, "llmgw_server_messages_received_total", kind="heartbeat") == 40
    assert at(s, "llmgw_server_refusals_total", reason="unauthorized_key") == 2
    assert at(s, "llmgw_server_zap_denials_total", reason="unknown key") == 1
    assert at(s, "llmgw_server_handler_failures_total") == 1
    assert at(s, "llmgw_server_reconcile_failures_total") == 3
    # The state changes; the next scrape says so, with nothing else updated.
    cp.nodes["n4"].state = NodeState.READY
    o.holding = "held: 3 of 4 nodes silent"
    s = scrape(m.registry)
    assert at(s, "llmgw_server_nodes", state="ready") == 3
    assert at(s, "llmgw_server_mass_loss_hold") == 1


def test_pass_durations() -> None:
    m = ServerMetrics()
    a = dep("a", 2)
    pending = {"a-0": rep(a, 0, ReplicaState.PENDING, placed=False)}
    placed = {"a-0": rep(a, 0, ReplicaState.STARTING, gen=2)}
    m.pass_done(0.002, placed, placed)  # a steady pass: nothing placed
    m.pass_done(0.5, pending, placed)
    s = scrape(m.registry)
    assert at(s, "llmgw_server_reconcile_pass_duration_seconds_count") == 2
    assert at(s, "llmgw_server_placement_duration_seconds_count") == 1
    assert at(s, "llmgw_server_placement_duration_seconds_sum") == 0.5
    assert at(s, "llmgw_server_replicas_placed_total") == 1


def test_placed_count() -> None:
    a = dep("a", 3)
    before = {"a-0": rep(a, 0, ReplicaState.READY, gen=1), "a-1": rep(a, 1, ReplicaState.PENDING, placed=False),
              "a-2": rep(a, 2, ReplicaState.READY, gen=4)}
    after = {"a-0": rep(a, 0, ReplicaState.READY, gen=1),  # unchanged
             "a-1": rep(a, 1, ReplicaState.STARTING, gen=5),  # placed
             "a-2": rep(a, 2, ReplicaState.STARTING, gen=6),  # restarted: a new generation
             "a-3": rep(a, 3, ReplicaState.PENDING, placed=False)}  # no room
    assert placed_count(before, after) == 2


class FakeStore:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def save_replicas(self, replicas: object, *, events: object = ()) -> str:
        self.calls.append("save_replicas")
        return "saved"

    def replicas(self) -> dict[str, Any]:
        return {}


def test_timed_store_times_writes_only() -> None:
    m = ServerMetrics()
    inner = FakeStore()
    store = m.timed(inner)
    assert isinstance(store, TimedStore)
    assert store.save_replicas({}, events=[]) == "saved"
    assert store.replicas() == {}
    assert inner.calls == ["save_replicas"]
    s = scrape(m.registry)
    assert at(s, "llmgw_server_store_write_duration_seconds_count", op="save_replicas") == 1
    assert at(s, "llmgw_server_store_write_duration_seconds_count", op="replicas") is None
    assert {"put_deployment", "save_replicas", "put_nodes", "set_cordoned"} <= STORE_WRITES


# ---- agent ----


class UtilNvml(FakeNvml):
    """The fake NVML with use figures: GPU i runs at 10*i percent."""

    def __init__(self, *a: Any, util: bool = True, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.util = util
        self.broken = False

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        if self.broken:
            raise FakeNVMLError("GPU is lost")
        return SimpleNamespace(total=80 * GIB, free=(80 - h - 1) * GIB, used=(h + 1) * GIB)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        if not self.util:
            raise FakeNVMLError("Not Supported")
        return SimpleNamespace(gpu=10 * h, memory=5)


def test_read_usage() -> None:
    usage = read_usage(UtilNvml(BUSES))
    assert [(u.index, u.uuid, u.memory_used, u.utilization) for u in usage] == [
        (i, f"GPU-{i:04d}", (i + 1) * GIB, i / 10) for i in range(4)]
    assert all(u.utilization is None for u in read_usage(UtilNvml(BUSES, util=False)))


def test_sampler_keeps_one_session_and_retries_after_a_failure() -> None:
    now = [0.0]
    nvml = UtilNvml(BUSES)
    sampler = GpuSampler(nvml, clock=lambda: now[0])
    assert sampler.sample() and sampler.sample()
    assert (nvml.inits, nvml.shutdowns) == (1, 0)
    nvml.broken = True
    assert sampler.sample() is None
    assert nvml.shutdowns == 1
    nvml.broken = False
    now[0] += RETRY / 2
    assert sampler.sample() is None  # not before RETRY
    now[0] += RETRY
    assert sampler.sample() is not None
    assert nvml.inits == 2
    sampler.close()
    assert nvml.shutdowns == 2
    assert GpuSampler(FakeNvml(BUSES, fail_init=True)).sample() is None
    assert GpuSampler(None).sample() is None


def agent_metrics(reports: tuple[EngineReport, ...], inventory: Inventory, nvml: Any) -> AgentMetrics:
    return AgentMetrics("n1", lambda: reports, lambda: (5, 2), lambda: inventory, GpuSampler(nvml))


async def test_agent_collector() -> None:
    reports = (EngineReport("a-0", 1, EngineState.READY), EngineReport("a-1", 1, EngineState.READY),
               EngineReport("b-0", 1, EngineState.STARTING), EngineReport("c-0", 1, EngineState.EXITED))
    inv = Inventory(gpus=tuple(Gpu(index=i, uuid=f"GPU-{i:04d}", name="x", pci_bus_id=BUSES[i], memory_total=81920,
                                   memory_free=81920 - 1024) for i in range(4)))
    m = agent_metrics(reports, inv, UtilNvml(BUSES))
    m.probed(0.003, True)
    m.probed(2.0, False)
    await m.refresh_gpus()
    s = scrape(m.registry)
    assert at(s, "llmgw_agent_engines", state="ready") == 2
    assert at(s, "llmgw_agent_engines", state="starting") == 1
    assert at(s, "llmgw_agent_engines", state="exited") == 1
    assert at(s, "llmgw_agent_engines", state="unhealthy") == 0
    assert at(s, "llmgw_agent_engine_starts_total") == 5
    assert at(s, "llmgw_agent_engine_restarts_total") == 2
    assert at(s, "llmgw_agent_health_probe_duration_seconds_count", result="ok") == 1
    assert at(s, "llmgw_agent_health_probe_duration_seconds_count", result="failed") == 1
    assert at(s, "llmgw_agent_gpus") == 4
    assert at(s, "llmgw_agent_gpu_nvml_up") == 1
    assert at(s, "llmgw_agent_gpu_memory_used_bytes", gpu="2", uuid="GPU-0002") == 3 * GIB
    assert at(s, "llmgw_agent_gpu_memory_total_bytes", gpu="2", uuid="GPU-0002") == 80 * GIB
    assert at(s, "llmgw_agent_gpu_utilization_ratio", gpu="3", uuid="GPU-0003") == 0.3
    assert at(s, "llmgw_agent_info", version=__import__("llmgw").__version__, node="n1") == 1


async def test_agent_without_nvml_reports_discovery_memory() -> None:
    inv = Inventory(gpus=(Gpu(index=0, uuid="GPU-sim", name="llmgw simulated GPU", pci_bus_id="00000000:01:00.0",
                              memory_total=24576,
                              memory_free=24576 - 512),))
    m = agent_metrics((), inv, None)
    await m.refresh_gpus()
    s = scrape(m.registry)
    assert at(s, "llmgw_agent_gpu_nvml_up") == 0
    assert at(s, "llmgw_agent_gpu_memory_used_bytes", gpu="0", uuid="GPU-sim") == 512 * 1024 * 1024
    assert at(s, "llmgw_agent_gpu_utilization_ratio", gpu="0", uuid="GPU-sim") is None
    assert at(s, "llmgw_agent_engines", state="ready") == 0

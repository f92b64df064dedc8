"""The orchestrator around a drain, without sockets: a real ControlPlane and SQLite store,
passes run at chosen times. A scaled-away replica leaves the endpoint table at once, keeps
its engine in its node's desired set while it drains, and goes from that set only once
its engine reported nothing in flight and the server's drain_grace has passed."""

from __future__ import annotations

from pathlib import Path

from attrs import evolve

from llmgw import PROTOCOL_VERSION
from llmgw.config.server import ServerConfig
from llmgw.model.deployment import Deployment, ReplicaState
from llmgw.model.engine import EngineKind, EngineReport, EngineState
from llmgw.model.inventory import Gpu, Inventory, NodeInfo
from llmgw.server.endpoints import endpoint_table
from llmgw.server.orchestrator import Orchestrator
from llmgw.server.peers.sessions import ControlPlane, Outgoing
from llmgw.server.store.sql import Store
from llmgw.transport import codec
from llmgw.transport.keys import KeyInfo
from llmgw.transport.messages import DesiredSet, EngineChanged, Hello

KEY = "K" * 40
GRACE = 4.0
CONFIG = ServerConfig(heartbeat_interval=5.0, drain_grace=GRACE)


def sets(out: list[Outgoing]) -> list[DesiredSet]:
    return [m for _, m in out if isinstance(m, DesiredSet)]


async def test_a_scaled_away_replica_leaves_the_table_then_its_node_once_idle(tmp_path: Path) -> None:
    cp = ControlPlane(config=CONFIG, authorized={KEY: KeyInfo("n1", "node", KEY.encode())})
    store = Store(str(tmp_path / "state.db"))
    orch = Orchestrator(cp, store, CONFIG, 0.0)
    gpu = Gpu(0, "GPU-0", "H100", 81920, 81000, "00000000:01:00.0")
    cp.handle(b"a", KEY, codec.encode(Hello(PROTOCOL_VERSION, NodeInfo("n1", "10.0.0.1"),
                                            Inventory(gpus=(gpu,)))), 1.0)
    d = Deployment(name="d", model="org/m", engine=EngineKind.SIMULATED, gpus_per_node=1,
                   replicas=1, drain_timeout=60.0)
    orch.deployments["d"] = d
    orch.mark_deployment("d")
    out, _ = await orch.run_pass(1.0)
    (spec,) = sets(out)[0].engines

    def report(in_flight: int, now: float) -> None:
        rep = EngineReport(spec.replica_id, spec.generation, EngineState.READY,
                           endpoint="http://10.0.0.1:8000", in_flight=in_flight)
        cp.handle(b"a", KEY, codec.encode(EngineChanged(rep)), now)

    report(-1, 2.0)
    await orch.run_pass(2.0)
    assert orch.replicas["d-0"].state == ReplicaState.READY
    assert [e["replica_id"] for e in endpoint_table(orch.replicas, orch.cp.nodes)["org/m"]] == ["d-0"]

    orch.deployments["d"] = evolve(d, replicas=0)
    orch.mark_deployment("d")
    report(3, 3.0)  # busy
    out, events = await orch.run_pass(3.0)
    r = orch.replicas["d-0"]
    assert r.state == ReplicaState.DRAINING and (r.drain_since, r.drain_until) == (3.0, 63.0)
    assert endpoint_table(orch.replicas, orch.cp.nodes) == {}  # no router sends it anything new
    assert not sets(out)  # its engine still runs
    assert orch.next_wake == 3.0 + GRACE
    assert any(e.text.startswith("draining: scaled down to 0") for e in events)

    report(0, 4.0)  # its requests are done, but a router may not have polled yet
    out, _ = await orch.run_pass(4.0)
    assert "d-0" in orch.replicas and not sets(out)
    out, events = await orch.run_pass(3.0 + GRACE)
    assert "d-0" not in orch.replicas
    assert [s.engines for s in sets(out)] == [()]  # now its node is told to stop it
    assert any(e.text.startswith("drained") for e in events)
    store.close()

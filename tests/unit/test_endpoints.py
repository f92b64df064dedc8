"""The endpoint table as plain data (server/endpoints.py): which replicas a router may
send to, which names are cold, and why the others serve nothing."""

from __future__ import annotations

from attrs import define, evolve, field

from llmgw.model.autoscale import Autoscale, Target
from llmgw.model.deployment import Deployment, Member, Replica, ReplicaState
from llmgw.model.engine import EngineKind, EngineReport
from llmgw.model.inventory import NodeInfo
from llmgw.model.node import NodeState
from llmgw.server.endpoints import endpoint_table, table


@define
class Side:
    """A node as the table reads it (peers/sessions.py's Node has more)."""

    state: NodeState
    engines: dict[str, EngineReport] = field(factory=dict)
    info: NodeInfo = NodeInfo("n", "10.0.0.1")
    key: str = ""


D = Deployment(name="d", model="org/m", engine=EngineKind.SIMULATED, gpus_per_node=1, replicas=2)


def replica(i: int, node: str, state: ReplicaState, spec: Deployment = D) -> Replica:
    return Replica(f"{spec.name}-{i}", spec.name, i, spec, state=state,
                   members=(Member(node, 0, (f"GPU-{i}",), 8000 + i, addr="10.0.0.1"),))


def test_a_lost_nodes_replicas_leave_the_table_unless_held() -> None:
    rs = {r.id: r for r in (replica(0, "ok", ReplicaState.READY),
                            replica(1, "suspect", ReplicaState.UNHEALTHY),
                            replica(2, "lost", ReplicaState.READY),
                            replica(3, "lost", ReplicaState.HELD),
                            replica(4, "gone", ReplicaState.READY),
                            replica(5, "ok", ReplicaState.STARTING))}
    nodes = {"ok": Side(NodeState.READY), "suspect": Side(NodeState.SUSPECT),
             "lost": Side(NodeState.LOST)}
    got = endpoint_table(rs, nodes)
    assert [(e["replica_id"], e["ready"]) for e in got["org/m"]] == [
        ("d-0", True), ("d-1", False), ("d-3", False)]
    assert all("adapters" not in e and "served" not in e for e in got["org/m"])


def test_a_name_that_serves_nothing_waits_with_its_reason_and_a_cold_one_is_held() -> None:
    cold = evolve(D, name="c", model="org/c", served_name="org/c", replicas=0,
                  autoscale=Autoscale(0, 2, Target.IN_FLIGHT, 4.0, idle_to_zero=60.0))
    deps = {"d": D, "c": cold}
    rs = {r.id: r for r in (replica(0, "n", ReplicaState.STARTING),
                            evolve(replica(1, "n", ReplicaState.PENDING), members=()))}
    got = table(deps, rs, {"d-1": "0/1 nodes fit: 1 lacked 1 free GPU"},
                {"n": Side(NodeState.READY)})
    assert got == {"models": {}, "cold": ["org/c"], "waiting": {
        "org/m": "org/m: 0 of 2 replicas ready (1 pending: 0/1 nodes fit: 1 lacked 1 free GPU,"
                 " 1 starting)"}}
    # Once a replica serves, the name no longer waits, and no cold key is sent when none is.
    ready = {"d-0": evolve(rs["d-0"], state=ReplicaState.READY)}
    assert table({"d": D}, ready, {}, {"n": Side(NodeState.READY)}) == {
        "models": {"org/m": [{"replica_id": "d-0", "url": "http://10.0.0.1:8000", "ready": True}]},
        "waiting": {}}


def test_a_replica_whose_engine_schedules_by_priority_is_marked() -> None:
    prio = evolve(D, name="p", model="org/p", served_name="org/p", engine=EngineKind.VLLM,
                  args=("--scheduling-policy", "priority"))
    fcfs = evolve(D, name="f", model="org/f", served_name="org/f", engine=EngineKind.VLLM)
    rs = {r.id: r for r in (replica(0, "n", ReplicaState.READY, prio),
                            replica(0, "n", ReplicaState.READY, fcfs))}
    got = endpoint_table(rs, {"n": Side(NodeState.READY)})
    assert got["org/p"][0]["priority"] is True
    assert "priority" not in got["org/f"][0]  # only where true: a router from before reads the rest

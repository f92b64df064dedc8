"""Reconcile against HCA health (issue 22, server side): a gang member riding an HCA whose
port left ACTIVE moves the way a drain moves it — a replacement first, on healthy HCAs,
then the old one stops; the HCA ACTIVE and quiet again counts in its fabric again."""

from __future__ import annotations

from attrs import evolve
from test_reconcile import World, dep, reports_for

from fakes.cluster import cluster, node
from llmgw.model.deployment import ReplicaState
from llmgw.model.engine import EngineState
from llmgw.model.inventory import Hca, IbPort
from llmgw.model.node import NodeState
from llmgw.server.placement.place import NodeView

S = ReplicaState
DOWN = "port 1 DOWN (Disabled)"


def _hca(name: str, *problems: str) -> Hca:
    return Hca(name, "g", (IbPort(1, "DOWN" if problems else "ACTIVE", "LinkUp", 200, "InfiniBand", "fe80"),),
               problems=problems)


def ib_node(node_id: str, gpus: int = 2) -> NodeView:
    v = node(node_id, gpus, fabrics=["ib"])
    return evolve(v, inventory=evolve(v.inventory, hcas=(_hca("mlx5_0"), _hca("mlx5_1"))))


def set_hca(w: World, node_id: str, name: str, *problems: str) -> None:
    v = w.nodes[node_id]
    hcas = tuple(_hca(h.name, *problems) if h.name == name else h for h in v.inventory.hcas)
    w.nodes[node_id] = evolve(v, inventory=evolve(v.inventory, hcas=hcas))


def serving(w: World) -> World:
    w.step()
    w.ready()
    assert w.states() == {"d-0": S.READY}
    return w


def test_a_gang_on_an_hca_going_down_is_replaced_first_on_healthy_hcas() -> None:
    w = serving(World(cluster(ib_node("a"), ib_node("b")), dep(1, gpus=1, nodes=2)))
    old = w.replicas["d-0"]
    assert {m.hcas for m in old.members} == {("mlx5_0", "mlx5_1")}
    set_hca(w, "b", "mlx5_0", DOWN)
    res = w.ready()
    # The old one serves on until its replacement is ready; the replacement rides mlx5_1 on b.
    assert w.replicas["d-0"].state == S.READY and w.replicas["d-0"].generation == old.generation
    new = w.replicas["d-1"]
    assert new.replaces == "d-0"
    assert {m.node_id: m.hcas for m in new.members} == {"a": ("mlx5_0", "mlx5_1"), "b": ("mlx5_1",)}
    assert any(e.text == f"HCA mlx5_0 ({DOWN}) on b unhealthy: d-1 takes over once ready"
               for e in res.events), [e.text for e in res.events]
    w.ready()
    assert sorted(w.replicas) == ["d-1"] and w.replicas["d-1"].replaces == ""
    assert w.states() == {"d-1": S.READY}


def test_an_hca_healthy_again_counts_again_and_moves_nothing() -> None:
    w = serving(World(cluster(ib_node("a"), ib_node("b"), ib_node("c")), dep(1, gpus=1, nodes=2)))
    on = w.replicas["d-0"].node_ids
    spare = next(n for n in ("a", "b", "c") if n not in on)
    # Both HCAs of the spare node down: it no longer counts in the fabric.
    set_hca(w, spare, "mlx5_0", DOWN)
    set_hca(w, spare, "mlx5_1", DOWN)
    set_hca(w, on[1], "mlx5_0", DOWN)
    set_hca(w, on[1], "mlx5_1", DOWN)
    w.ready()
    # Nowhere to go: it stays serving, its replacement waits and says why.
    assert w.replicas["d-0"].state == S.READY
    assert not w.replicas["d-1"].placed and "had their fabric down" in w.replicas["d-1"].reason
    # The spare node's HCA back: the node counts again, and the replacement goes there.
    set_hca(w, spare, "mlx5_1")
    w.ready()
    new = w.replicas["d-1"]
    assert new.replaces == "d-0" and spare in new.node_ids and on[1] not in new.node_ids
    assert {m.node_id: m.hcas for m in new.members}[spare] == ("mlx5_1",)


def test_a_gang_in_backoff_restarts_off_the_sick_hca() -> None:
    w = World(cluster(ib_node("a"), ib_node("b")), dep(1, gpus=1, nodes=2))
    w.step()
    w.step(reports_for(w.replicas, EngineState.EXITED, exit_code=1))
    assert w.states() == {"d-0": S.BACKOFF}
    set_hca(w, "a", "mlx5_1", "port 1 link_downed +1 in 2s")
    w.now = w.replicas["d-0"].backoff_until + 1
    w.step()
    r = w.replicas["d-0"]
    assert r.placed and {m.node_id: m.hcas for m in r.members}["a"] == ("mlx5_0",)


def test_single_node_replicas_ignore_hcas() -> None:
    w = serving(World(cluster(ib_node("a")), dep(1, gpus=1)))
    set_hca(w, "a", "mlx5_0", DOWN)
    set_hca(w, "a", "mlx5_1", DOWN)
    w.ready()
    assert sorted(w.replicas) == ["d-0"] and w.states() == {"d-0": S.READY}
    assert w.nodes["a"].state == NodeState.READY

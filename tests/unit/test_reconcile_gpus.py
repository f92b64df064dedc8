"""Reconcile against GPU health (issue 18 item 3, server side): a replica holding a GPU
that turns unhealthy moves the way a drain moves it, replacement first; a GPU that is
only releasing, or held by another process, moves nothing."""

from __future__ import annotations

from attrs import evolve
from test_reconcile import World, dep, reports_for

from fakes.cluster import cluster, node
from llmgw.model.deployment import ReplicaState
from llmgw.model.engine import EngineReport, EngineState
from llmgw.model.inventory import GpuProcess
from llmgw.server.reconcile.rules import NodeDelta, ReconcileState, reconcile_dirty

S = ReplicaState



def set_gpu(w: World, node_id: str, uuid: str, **changes: object) -> None:
    v = w.nodes[node_id]
    gpus = tuple(evolve(g, **changes) if g.uuid == uuid else g for g in v.inventory.gpus)  # type: ignore[arg-type]
    w.nodes[node_id] = evolve(v, inventory=evolve(v.inventory, gpus=gpus))


def serving(w: World) -> World:
    w.step()
    w.ready()
    assert w.states() == {"d-0": S.READY}
    return w


def test_a_replica_on_a_gpu_turning_unhealthy_is_replaced_first() -> None:
    w = serving(World(cluster(node("a", 2)), dep(1, gpus=1)))
    old = w.replicas["d-0"]
    (gpu,) = old.gpus
    set_gpu(w, "a", gpu, problems=("row remap pending",))
    res = w.ready()
    # The old one serves on until its replacement is ready; the replacement avoids the GPU.
    assert w.replicas["d-0"].state == S.READY and w.replicas["d-0"].generation == old.generation
    new = w.replicas["d-1"]
    assert new.replaces == "d-0" and gpu not in new.gpus and new.node_ids == ("a",)
    assert any(e.text == f"GPU {_index(gpu)} on a unhealthy (row remap pending): d-1 takes over once ready"
               for e in res.events)
    w.ready()
    assert sorted(w.replicas) == ["d-1"] and w.replicas["d-1"].replaces == ""
    w.ready()
    assert w.states() == {"d-1": S.READY}


def _index(uuid: str) -> int:
    return int(uuid.rsplit("-", 1)[1])


def test_a_replica_not_serving_on_an_unhealthy_gpu_is_placed_again_at_once() -> None:
    w = World(cluster(node("a", 2)), dep(1, gpus=1))
    w.step()
    (gpu,) = w.replicas["d-0"].gpus
    set_gpu(w, "a", gpu, problems=("Xid 79 at 12:00:01",))
    w.step(reports_for(w.replicas, EngineState.STARTING))
    r = w.replicas["d-0"]
    assert sorted(w.replicas) == ["d-0"] and r.placed and gpu not in r.gpus


def test_the_gpu_healthy_again_before_the_replacement_is_ready_keeps_the_old_one() -> None:
    w = serving(World(cluster(node("a", 2)), dep(1, gpus=1)))
    old = w.replicas["d-0"]
    set_gpu(w, "a", old.gpus[0], problems=("2 volatile uncorrected ECC errors",))
    w.ready()
    assert "d-1" in w.replicas
    set_gpu(w, "a", old.gpus[0], problems=())
    w.step(reports_for({"d-0": w.replicas["d-0"]}))  # d-1 still starting
    assert sorted(w.replicas) == ["d-0"] and w.replicas["d-0"].generation == old.generation


def test_nowhere_to_move_keeps_the_old_one_serving_and_says_why() -> None:
    w = serving(World(cluster(node("a", 1)), dep(1, gpus=1)))
    set_gpu(w, "a", w.replicas["d-0"].gpus[0], problems=("row remap pending",))
    w.ready()
    assert w.replicas["d-0"].state == S.READY
    assert w.replicas["d-1"].state == S.PENDING
    assert "GPU 0 unhealthy (row remap pending)" in w.replicas["d-1"].reason


def test_releasing_or_foreign_processes_move_nothing() -> None:
    w = serving(World(cluster(node("a", 2)), dep(1, gpus=1)))
    gen = w.replicas["d-0"].generation
    gpu = w.replicas["d-0"].gpus[0]
    set_gpu(w, "a", gpu, processes=(GpuProcess(4242, "python train.py", 2048),), memory_free=100)
    w.ready()
    set_gpu(w, "a", gpu, releasing="d-9 stopped; 3 GiB still held")
    for _ in range(3):
        w.ready()
    assert w.states() == {"d-0": S.READY} and w.replicas["d-0"].generation == gen


def test_a_replica_on_a_healthy_gpu_of_the_same_node_stays() -> None:
    w = World(cluster(node("a", 3)), dep(2, gpus=1))
    w.step()
    w.ready()
    on = {rid: r.gpus[0] for rid, r in w.replicas.items()}
    spare = ({f"GPU-a-{i}" for i in range(3)} - set(on.values())).pop()
    set_gpu(w, "a", on["d-0"], problems=("row remap pending",))
    for _ in range(3):
        w.ready()
    assert w.replicas["d-1"].gpus == (on["d-1"],) and w.replicas["d-1"].state == S.READY
    moved = [r for r in w.replicas.values() if r.gpus == (spare,)]
    assert len(moved) == 1 and "d-0" not in w.replicas


def test_a_replica_in_backoff_restarts_elsewhere_not_on_its_unhealthy_gpu() -> None:
    w = World(cluster(node("a", 2)), dep(1, gpus=1), backoff_base=5.0)
    w.step()
    (gpu,) = w.replicas["d-0"].gpus
    w.step(reports_for(w.replicas, EngineState.FAILED, exit_code=1))
    assert w.replicas["d-0"].state == S.BACKOFF
    set_gpu(w, "a", gpu, problems=("lost: GPU is lost",))
    w.now += 10
    res = w.step()
    r = w.replicas["d-0"]
    assert r.placed and gpu not in r.gpus
    assert any("unhealthy (lost: GPU is lost): placing again" in e.text for e in res.events)


def test_kept_state_moves_it_on_a_node_delta_as_the_server_feeds_it() -> None:
    nodes = cluster(node("a", 2))
    d = dep(1, gpus=1)
    state = ReconcileState(nodes)
    res = reconcile_dirty(state, {"d": d}, 1000.0)
    r = res.replicas["d-0"]
    ready = (EngineReport(replica_id=r.id, generation=r.generation, state=EngineState.READY),)
    state.node(NodeDelta("a", nodes["a"], ready))
    reconcile_dirty(state, {"d": d}, 1001.0)
    assert state.replicas["d-0"].state == S.READY
    v = nodes["a"]
    gpus = tuple(evolve(g, problems=("MIG mode is on",)) if g.uuid == r.gpus[0] else g
                 for g in v.inventory.gpus)
    sick = evolve(v, inventory=evolve(v.inventory, gpus=gpus))
    state.node(NodeDelta("a", sick, ready))
    assert set(state.sick["a"]) == {r.gpus[0]}
    res = reconcile_dirty(state, {"d": d}, 1002.0)
    assert res.replicas["d-1"].replaces == "d-0" and r.gpus[0] not in res.replicas["d-1"].gpus
    state.node(NodeDelta("a", nodes["a"], ready))  # healthy again
    assert "a" not in state.sick

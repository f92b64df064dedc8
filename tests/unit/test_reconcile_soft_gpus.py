"""Soft GPU problems on the server (issue 30 item 3): a GPU with a pending row remap or
volatile ECC errors takes no new replica, and what runs on it stays (no replacement, no
gang restart); a hard problem still moves it as a drain does."""

from __future__ import annotations

from attrs import evolve
from test_reconcile import World, dep
from test_reconcile_gpus import set_gpu

from fakes.cluster import cluster, node
from llmgw.model.deployment import ReplicaState
from llmgw.model.engine import EngineReport, EngineState
from llmgw.model.inventory import soft
from llmgw.server.reconcile.rules import NodeDelta, ReconcileState, reconcile_dirty
from llmgw.server.status import gpu_state

S = ReplicaState
REMAP = soft("row remap pending (reset the GPU when it is idle)")
ECC = soft("2 volatile uncorrected ECC errors")


def serving(w: World) -> World:
    w.step()
    w.ready()
    assert w.states() == {"d-0": S.READY}
    return w


def test_a_replica_on_a_gpu_with_a_soft_problem_stays() -> None:
    """Before issue 30 a pending remap made d-1 replace d-0 on another GPU."""
    w = serving(World(cluster(node("a", 2)), dep(1, gpus=1)))
    old = w.replicas["d-0"]
    set_gpu(w, "a", old.gpus[0], problems=(REMAP, ECC))
    for _ in range(4):
        res = w.ready()
        assert not [e for e in res.events if "unhealthy" in e.text]
    assert sorted(w.replicas) == ["d-0"]
    assert w.replicas["d-0"].state == S.READY and w.replicas["d-0"].generation == old.generation


def test_a_gang_on_a_soft_gpu_is_not_restarted() -> None:
    w = World(cluster(node("a", 1, fabrics=["ib"]), node("b", 1, fabrics=["ib"])), dep(1, gpus=1, nodes=2))
    w.step()
    w.ready()
    assert w.states() == {"d-0": S.READY}
    gen = w.replicas["d-0"].generation
    set_gpu(w, "b", w.replicas["d-0"].members[1].gpus[0], problems=(REMAP,))
    for _ in range(3):
        w.ready()
    assert sorted(w.replicas) == ["d-0"] and w.replicas["d-0"].generation == gen


def test_a_new_replica_avoids_a_gpu_with_a_soft_problem() -> None:
    nodes = cluster(node("a", 2))
    w = World(nodes, dep(1, gpus=1))
    set_gpu(w, "a", "GPU-a-0", problems=(REMAP,))
    w.step()
    assert w.replicas["d-0"].gpus == ("GPU-a-1",)
    # A second replica finds no room, and says why.
    w.deps["d"] = evolve(w.deps["d"], replicas=2)
    w.ready()
    pending = w.replicas["d-1"]
    assert pending.state == S.PENDING
    assert "a: GPU 0 taking no new work (row remap pending" in pending.reason


def test_a_hard_problem_still_moves_what_runs() -> None:
    w = serving(World(cluster(node("a", 2)), dep(1, gpus=1)))
    gpu = w.replicas["d-0"].gpus[0]
    set_gpu(w, "a", gpu, problems=(REMAP, "NVML asks to reset the GPU (recovery action 1)"))
    res = w.ready()
    assert w.replicas["d-1"].replaces == "d-0" and gpu not in w.replicas["d-1"].gpus
    assert any("unhealthy (NVML asks to reset the GPU (recovery action 1))" in e.text for e in res.events)


def test_kept_state_counts_only_hard_problems_as_sick() -> None:
    nodes = cluster(node("a", 2))
    d = dep(1, gpus=1)
    state = ReconcileState(nodes)
    r = reconcile_dirty(state, {"d": d}, 1000.0).replicas["d-0"]
    ready = (EngineReport(replica_id=r.id, generation=r.generation, state=EngineState.READY),)
    v = nodes["a"]
    gpus = tuple(evolve(g, problems=(REMAP,)) if g.uuid == r.gpus[0] else g for g in v.inventory.gpus)
    state.node(NodeDelta("a", evolve(v, inventory=evolve(v.inventory, gpus=gpus)), ready))
    assert "a" not in state.sick
    res = reconcile_dirty(state, {"d": d}, 1001.0)
    assert sorted(res.replicas) == ["d-0"]


def test_status_calls_a_soft_gpu_degraded() -> None:
    g = node("a", 1).inventory.gpus[0]
    assert gpu_state(evolve(g, problems=(REMAP,))) == "degraded"
    assert gpu_state(evolve(g, problems=(REMAP, "lost: GPU is lost"))) == "unhealthy"
    assert gpu_state(evolve(g, problems=("row remap pending",))) == "unhealthy"  # an agent from before

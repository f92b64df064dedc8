"""Reconciliation on fixed inventories: every rule, pass by pass."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from attrs import evolve

from fakes.cluster import cluster, node
from llmgw.model.deployment import Deployment, Replica, ReplicaState
from llmgw.model.engine import EngineKind, EngineReport, EngineState
from llmgw.model.node import NodeState
from llmgw.server.placement.place import NodeView
from llmgw.server.reconcile.rules import ReconcileResult, ReconcileSettings, desired_sets, reconcile

S = ReplicaState


def dep(replicas: int = 1, gpus: int = 8, nodes: int = 1, **kw: object) -> Deployment:
    # drain_timeout 0: stops are immediate here, so each rule is seen in one pass; the
    # drain before a stop has its own tests (test_reconcile_drain.py).
    kw.setdefault("drain_timeout", 0.0)
    return Deployment(
        name="d",
        model="org/m",
        engine=EngineKind.VLLM,
        gpus_per_node=gpus,
        replicas=replicas,
        nodes=nodes,
        **kw,  # type: ignore[arg-type]
    )


def reports_for(
    replicas: Mapping[str, Replica], state: EngineState = EngineState.READY, **kw: object
) -> dict[str, list[EngineReport]]:
    """Every placed replica's engines report `state`."""
    out: dict[str, list[EngineReport]] = {}
    for r in replicas.values():
        for m in r.members:
            rep = EngineReport(replica_id=r.id, generation=r.generation, state=state, **kw)  # type: ignore[arg-type]
            out.setdefault(m.node_id, []).append(rep)
    return out


class World:
    """Runs passes, carrying replicas and the generation floor like the server would."""

    def __init__(self, nodes: dict[str, NodeView], *deps: Deployment, **settings: float) -> None:
        self.nodes = nodes
        self.deps = {d.name: d for d in deps}
        self.replicas: dict[str, Replica] = {}
        self.floor = 0
        self.now = 1000.0
        self.settings = ReconcileSettings(**settings)  # type: ignore[arg-type]
        self.last: ReconcileResult | None = None

    def step(self, reports: Mapping[str, Iterable[EngineReport]] | None = None) -> ReconcileResult:
        res = reconcile(
            self.deps, self.replicas, self.nodes, reports or {}, self.now, self.settings, self.floor
        )
        self.replicas, self.floor, self.last = res.replicas, res.generation_floor, res
        return res

    def ready(self) -> ReconcileResult:
        return self.step(reports_for(self.replicas))

    def set_node(self, node_id: str, **kw: object) -> None:
        self.nodes[node_id] = evolve(self.nodes[node_id], **kw)  # type: ignore[arg-type]

    def states(self) -> dict[str, S]:
        return {rid: r.state for rid, r in self.replicas.items()}


def test_place_start_ready_and_desired_sets() -> None:
    w = World(cluster(node("a"), node("b")), dep(2))
    res = w.step()
    assert sorted(res.replicas) == ["d-0", "d-1"]
    assert w.states() == {"d-0": S.STARTING, "d-1": S.STARTING}
    assert res.changed_nodes == {"a", "b"}
    sets = desired_sets(res.replicas.values(), ["a", "b", "c"])
    assert len(sets["a"]) == 1 and len(sets["b"]) == 1 and sets["c"] == ()
    spec = sets["a"][0]
    assert spec.tensor_parallel == 8 and len(spec.gpus) == 8 and spec.gang is None
    res = w.ready()
    assert w.states() == {"d-0": S.READY, "d-1": S.READY}
    assert res.changed_nodes == frozenset()
    assert any(e.text == "ready" for e in res.events)


def test_unschedulable_is_pending_with_reason_then_placed_when_cluster_grows() -> None:
    w = World(cluster(node("a", 4)), dep(1))
    res = w.step()
    assert w.states() == {"d-0": S.PENDING}
    assert res.pending["d-0"].startswith("0/1 nodes fit: 1 lacked 8 free GPUs")
    w.nodes["b"] = node("b")
    w.step()
    assert w.states() == {"d-0": S.STARTING} and w.replicas["d-0"].node_ids == ("b",)


def test_crash_restarts_with_capped_exponential_backoff_and_crash_looping() -> None:
    w = World(cluster(node("a")), dep(1), backoff_base=5, backoff_cap=20, crashloop_after=3)
    w.step()
    delays = []
    for attempt in range(1, 6):
        r = w.replicas["d-0"]
        res = w.step(reports_for(w.replicas, EngineState.EXITED, exit_code=1, log_tail=("oops",)))
        r2 = w.replicas["d-0"]
        assert r2.restarts == attempt and r2.last_log_tail == ("oops",)
        assert r2.state == (S.CRASH_LOOPING if attempt >= 3 else S.BACKOFF)
        assert desired_sets(res.replicas.values()) == {}  # the exited engine is not wanted
        assert r2.node_ids == ("a",)  # a single node restarts in place
        delays.append(r2.backoff_until - w.now)
        w.now = r2.backoff_until - 0.1
        w.step()
        assert w.replicas["d-0"].state in (S.BACKOFF, S.CRASH_LOOPING)
        w.now = r2.backoff_until
        w.step()
        r3 = w.replicas["d-0"]
        assert r3.state == S.STARTING and r3.generation > r.generation
    assert delays == [5, 10, 20, 20, 20]


def test_restarts_reset_after_stable_ready() -> None:
    w = World(cluster(node("a")), dep(1), stable_after=60)
    w.step()
    w.step(reports_for(w.replicas, EngineState.FAILED, reason="startup timeout"))
    assert w.replicas["d-0"].reason == "startup timeout"
    w.now += 5
    w.step()
    w.ready()
    assert w.replicas["d-0"].restarts == 1
    w.now += 61
    w.ready()
    assert w.replicas["d-0"].restarts == 0


def test_gang_member_exit_stops_whole_gang_and_places_again() -> None:
    c = cluster(*(node(f"n{i}", fabrics=["ib"]) for i in range(3)))
    w = World(c, dep(1, nodes=2))
    w.step()
    w.ready()
    r = w.replicas["d-0"]
    assert r.state == S.READY and r.fabric == "ib"
    specs = desired_sets([r])
    assert {s.gang.rank for v in specs.values() for s in v if s.gang} == {0, 1}
    head = r.members[0]
    assert all(s.gang and s.gang.head_addr == head.addr for v in specs.values() for s in v)
    one = {r.members[1].node_id: [EngineReport("d-0", r.generation, EngineState.EXITED)]}
    res = w.step(one)
    r2 = w.replicas["d-0"]
    assert r2.state == S.BACKOFF and not r2.placed  # both members stopped
    assert res.changed_nodes == set(r.node_ids)
    w.now = r2.backoff_until
    w.step()
    r3 = w.replicas["d-0"]
    assert r3.placed and r3.generation > r.generation and len(r3.members) == 2


def test_suspect_node_replicas_stay() -> None:
    w = World(cluster(node("a"), node("b")), dep(1))
    w.step()
    w.ready()
    where = w.replicas["d-0"].node_ids[0]
    w.set_node(where, state=NodeState.SUSPECT, silent_since=w.now)
    res = w.step()
    r = w.replicas["d-0"]
    assert r.node_ids == (where,) and r.state == S.READY and res.changed_nodes == frozenset()


def test_lost_node_replica_placed_elsewhere_with_new_generation_fencing() -> None:
    w = World(cluster(node("a"), node("b"), node("c"), node("d")), dep(1))
    w.step()
    w.ready()
    old = w.replicas["d-0"]
    where = old.node_ids[0]
    w.set_node(where, state=NodeState.LOST, silent_since=w.now - 70)
    res = w.step()
    new = w.replicas["d-0"]
    assert new.node_ids != (where,) and new.generation > old.generation
    assert where in res.changed_nodes
    # The node comes back: its desired set no longer holds the old generation.
    w.set_node(where, state=NodeState.READY, silent_since=None)
    w.step({where: [EngineReport("d-0", old.generation, EngineState.READY)]})
    sets = desired_sets(w.replicas.values(), [where])
    assert sets[where] == ()
    assert w.replicas["d-0"].generation == new.generation


def test_gang_member_node_lost_replaces_whole_gang() -> None:
    c = cluster(*(node(f"n{i}", fabrics=["ib"]) for i in range(6)))
    w = World(c, dep(1, nodes=2))
    w.step()
    w.ready()
    old = w.replicas["d-0"]
    w.set_node(old.members[1].node_id, state=NodeState.LOST, silent_since=w.now - 70)
    w.step()
    new = w.replicas["d-0"]
    assert new.generation > old.generation and old.members[1].node_id not in new.node_ids
    assert len(new.members) == 2


def test_mass_loss_guard_holds_replacement() -> None:
    c = cluster(*(node(f"n{i}") for i in range(10)))
    w = World(c, dep(4), grace_period=60)
    w.step()
    w.ready()
    placed = {r.node_ids[0] for r in w.replicas.values()}
    silent = sorted(placed)[:2] + sorted(set(c) - placed)[:2]  # 4 of 10 > 30%
    for n in silent:
        w.set_node(n, state=NodeState.LOST, silent_since=w.now - 61)
    res = w.step()
    assert res.holding.startswith("holding: 4 of 10 nodes silent, suspecting the server's own")
    held = [r for r in w.replicas.values() if r.state == S.HELD]
    assert len(held) == 2 and all(r.node_ids[0] in silent for r in held)
    assert res.changed_nodes == frozenset()
    # Nodes return: replicas resume where they were, no churn.
    for n in silent:
        w.set_node(n, state=NodeState.READY, silent_since=None)
    res = w.ready()
    assert not res.holding and all(r.state == S.READY for r in w.replicas.values())


def test_one_lost_node_of_three_is_not_mass_loss() -> None:
    # A third of a three-node cluster is over 30%, but one silent node says nothing
    # about the server's own network: its replicas move.
    c = cluster(*(node(f"n{i}") for i in range(3)))
    w = World(c, dep(1))
    w.step()
    w.ready()
    victim = w.replicas["d-0"].node_ids[0]
    w.set_node(victim, state=NodeState.LOST, silent_since=w.now - 61)
    res = w.step()
    assert not res.holding and w.replicas["d-0"].node_ids != (victim,)
    # Two of three silent is held.
    other = next(n for n in c if n != victim)
    w.set_node(other, state=NodeState.LOST, silent_since=w.now - 1)
    assert w.step().holding.startswith("holding: 2 of 3 nodes silent")


def test_few_lost_nodes_are_not_mass_loss() -> None:
    c = cluster(*(node(f"n{i}") for i in range(10)))
    w = World(c, dep(3))
    w.step()
    w.ready()
    victim = w.replicas["d-0"].node_ids[0]
    w.set_node(victim, state=NodeState.LOST, silent_since=w.now - 61)
    res = w.step()
    assert not res.holding and w.replicas["d-0"].node_ids != (victim,)


def test_scale_up_and_down_prefers_unready() -> None:
    w = World(cluster(*(node(f"n{i}") for i in range(4))), dep(2))
    w.step()
    w.ready()
    w.deps["d"] = dep(4)
    w.step()
    assert sorted(w.replicas) == ["d-0", "d-1", "d-2", "d-3"]
    w.deps["d"] = dep(2)
    res = w.step()
    assert sorted(w.replicas) == ["d-0", "d-1"]  # the two not yet ready went
    assert sum("scaled down" in e.text for e in res.events) == 2
    w.deps["d"] = dep(0)
    w.step()
    assert w.replicas == {}


def test_delete_deployment_stops_everything() -> None:
    w = World(cluster(node("a")), dep(1))
    w.step()
    w.deps = {}
    res = w.step()
    assert res.replicas == {} and res.changed_nodes == {"a"}
    assert desired_sets(res.replicas.values(), ["a"]) == {"a": ()}


def _ready_count(w: World) -> int:
    return sum(r.state == S.READY for r in w.replicas.values())


def test_rolling_update_surges_one_at_a_time_never_below_desired() -> None:
    w = World(cluster(*(node(f"n{i}") for i in range(4))), dep(2))
    w.step()
    w.ready()
    w.deps["d"] = dep(2, args=("--max-model-len", "4096"))
    new_hash = w.deps["d"].template_hash()
    for _ in range(12):
        w.ready()
        assert _ready_count(w) >= 2
        assert len(w.replicas) <= 3  # surge one
    assert len(w.replicas) == 2
    assert all(r.spec.template_hash() == new_hash for r in w.replicas.values())
    assert all(r.state == S.READY for r in w.replicas.values())


def test_rolling_update_without_room_goes_down_then_up() -> None:
    w = World(cluster(node("a"), node("b")), dep(2))
    w.step()
    w.ready()
    w.deps["d"] = dep(2, env={"X": "1"})
    res = w.ready()
    assert any("down then up" in e.text for e in res.events)
    assert len(w.replicas) == 2 and _ready_count(w) == 1  # one at a time
    for _ in range(6):
        w.ready()
    new_hash = w.deps["d"].template_hash()
    assert all(r.spec.template_hash() == new_hash for r in w.replicas.values())
    assert _ready_count(w) == 2


def test_drain_moves_replicas_new_ready_before_old_stops() -> None:
    w = World(cluster(node("a"), node("b"), node("c")), dep(2))
    w.step()
    w.ready()
    victim = w.replicas["d-0"].node_ids[0]
    w.set_node(victim, draining=True)
    for _ in range(5):
        w.ready()
        assert _ready_count(w) >= 2
    assert all(victim not in r.node_ids for r in w.replicas.values())
    assert len(w.replicas) == 2
    assert desired_sets(w.replicas.values(), [victim])[victim] == ()


def test_drain_without_room_keeps_old_replica() -> None:
    w = World(cluster(node("a"), node("b")), dep(2))
    w.step()
    w.ready()
    w.set_node("a", draining=True)
    for _ in range(3):
        w.ready()
    on_a = [r for r in w.replicas.values() if "a" in r.node_ids]
    assert len(on_a) == 1 and on_a[0].state == S.READY
    pending = [r for r in w.replicas.values() if r.state == S.PENDING]
    assert len(pending) == 1 and pending[0].replaces == on_a[0].id


def test_cordon_blocks_new_placement_only() -> None:
    w = World(cluster(node("a"), node("b")), dep(1))
    w.step()
    where = w.replicas["d-0"].node_ids[0]
    w.set_node(where, cordoned=True)
    w.ready()
    assert w.replicas["d-0"].node_ids == (where,)
    w.deps["d"] = dep(2)
    w.step()
    assert w.replicas["d-1"].node_ids != (where,)


def test_generations_never_repeat_after_delete_and_recreate() -> None:
    w = World(cluster(node("a")), dep(1))
    w.step()
    g1 = w.replicas["d-0"].generation
    w.deps = {}
    w.step()
    w.deps = {"d": dep(1)}
    w.step()
    assert w.replicas["d-0"].generation > g1


def test_server_restart_adopts_reports_without_restarts() -> None:
    w = World(cluster(node("a"), node("b")), dep(2))
    w.step()
    w.ready()
    saved = dict(w.replicas)
    w2 = World(w.nodes, dep(2))
    w2.replicas, w2.floor = saved, w.floor
    res = w2.step(reports_for(saved))
    assert res.changed_nodes == frozenset()
    assert {r.generation for r in res.replicas.values()} == {r.generation for r in saved.values()}


# ---- issue 10, item 1: drain, uncordon, scale down ----


def test_drain_then_uncordon_drops_the_replacements_and_restarts_nothing() -> None:
    # One node with room for the two replicas only, as in `llmgw dev`.
    w = World(cluster(node("a", 2)), dep(2, gpus=1))
    w.step()
    w.ready()
    serving = {rid: r.generation for rid, r in w.replicas.items()}
    w.set_node("a", cordoned=True, draining=True)
    w.ready()
    assert {r.id for r in w.replicas.values() if r.replaces} == {"d-2", "d-3"}
    assert all(w.replicas[x].state == S.PENDING for x in ("d-2", "d-3"))
    # Nowhere to move: the old replicas say so, and so does the deployment's status.
    assert w.replicas["d-0"].reason.startswith("draining, with nowhere to move: 0/1 nodes fit")
    w.set_node("a", cordoned=False, draining=False)
    w.ready()
    assert sorted(w.replicas) == ["d-0", "d-1"]
    assert {rid: r.generation for rid, r in w.replicas.items()} == serving
    assert all(r.state == S.READY and r.reason == "" for r in w.replicas.values())
    assert not w.last or not w.last.pending


def test_scale_down_while_a_drain_waits_stops_no_replica_that_serves_instead_of_one_that_does_not() -> None:
    w = World(cluster(node("a", 2)), dep(2, gpus=1))
    w.step()
    w.ready()
    w.set_node("a", cordoned=True, draining=True)
    w.ready()
    w.deps["d"] = dep(1, gpus=1)
    w.ready()
    ready = [r for r in w.replicas.values() if r.state == S.READY]
    assert len(ready) == 1
    # The one left serving keeps serving (same generation) with its replacement pending.
    w.set_node("a", cordoned=False, draining=False)
    before = {rid: r.generation for rid, r in w.replicas.items() if r.state == S.READY}
    w.ready()
    assert {rid: r.generation for rid, r in w.replicas.items()} == before


def test_scale_down_stops_not_ready_before_ready_and_newest_first() -> None:
    w = World(cluster(node("a"), node("b"), node("c"), node("d")), dep(4))
    w.step()
    reports = reports_for({k: v for k, v in w.replicas.items() if k in ("d-0", "d-2")})
    w.step(reports)
    assert w.states() == {"d-0": S.READY, "d-1": S.STARTING, "d-2": S.READY, "d-3": S.STARTING}
    w.deps["d"] = dep(2)
    w.step(reports)
    assert sorted(w.replicas) == ["d-0", "d-2"]
    w.deps["d"] = dep(1)
    w.step(reports)
    assert sorted(w.replicas) == ["d-0"] or sorted(w.replicas) == ["d-2"]
    assert w.replicas[next(iter(w.replicas))].state == S.READY


def test_every_state_change_is_in_the_lifecycle_table() -> None:
    import pytest

    from llmgw.server.reconcile.replica_states import InvalidReplicaTransition, ReplicaEvent, next_state

    assert next_state(S.PENDING, ReplicaEvent.PLACED) == S.STARTING
    with pytest.raises(InvalidReplicaTransition, match="'restart' is not valid in state 'ready'"):
        next_state(S.READY, ReplicaEvent.RESTART)
    with pytest.raises(InvalidReplicaTransition):
        next_state(S.BACKOFF, ReplicaEvent.ENGINES_READY)


def test_port_conflict_places_again_on_another_port_without_backoff() -> None:
    w = World(cluster(node("a")), dep(1))
    w.step()
    r = w.replicas["d-0"]
    port = r.members[0].port
    w.set_node("a", blocked_ports=frozenset({port}))
    w.step(reports_for(w.replicas, EngineState.FAILED, conflict_port=port, reason="port in use"))
    r2 = w.replicas["d-0"]
    assert r2.state == S.STARTING and r2.restarts == 0
    assert r2.members[0].port != port and r2.generation > r.generation


def test_a_drain_replacement_left_behind_by_a_spec_change_does_not_block_the_roll() -> None:
    """Found by the model-based test: a drain's replacement, made with a newer spec,
    outlived the drain and waited for room that the roll it blocked would have made."""
    w = World(cluster(node("a", 2), node("b", 2)), dep(2, gpus=1))
    w.set_node("b", cordoned=True)
    w.step()
    w.ready()
    w.set_node("b", cordoned=False)
    w.ready()
    w.deps["d"] = dep(2, gpus=1, args=("--v1",))  # a spec change: rolls
    w.set_node("a", cordoned=True, draining=True)  # and a drain of the full node at once
    w.set_node("b", cordoned=True)
    w.ready()
    w.set_node("a", cordoned=False, draining=False)
    for _ in range(8):
        w.ready()
    assert not w.last or not w.last.pending
    assert sorted(r.spec.args for r in w.replicas.values()) == [("--v1",), ("--v1",)]
    assert all(r.state == S.READY and not r.replaces for r in w.replicas.values())


def test_not_ready_reason_names_counts_and_why_pending() -> None:
    from llmgw.server.endpoints import not_ready_reason

    w = World(cluster(node("a", 8)), dep(2))
    w.step()
    mine = list(w.replicas.values())
    assert not_ready_reason(w.deps["d"], mine, w.last.pending if w.last else {}) == (
        "org/m: 0 of 2 replicas ready (1 pending: 0/1 nodes fit: 1 lacked 8 free GPUs, 1 starting)")

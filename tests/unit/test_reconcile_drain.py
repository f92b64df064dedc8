"""Stops that are no failure drain first: the rule (drain.py) on plain data, then each
kind of stop through reconcile, pass by pass."""

from __future__ import annotations

from attrs import evolve
from test_reconcile import World, dep, reports_for

from fakes.cluster import cluster, node
from llmgw.model.deployment import Member, Replica, ReplicaState
from llmgw.model.engine import EngineReport, EngineState
from llmgw.model.node import NodeState
from llmgw.server.reconcile.drain import DEFAULT_GRACE, drain_verdict
from llmgw.server.reconcile.replica_states import DRAINS_FIRST, ReplicaEvent, next_state
from llmgw.server.reconcile.rules import desired_sets

S = ReplicaState
GRACE = DEFAULT_GRACE


def draining(since: float = 100.0, timeout: float = 60.0, nodes: tuple[str, ...] = ("a",)) -> Replica:
    members = tuple(Member(n, i, (f"GPU-{n}-0",), 8000) for i, n in enumerate(nodes))
    return Replica("d-1", "d", 1, dep(), generation=3, members=members, state=S.DRAINING,
                   drain_since=since, drain_until=since + timeout)


def report(in_flight: int, state: EngineState = EngineState.READY) -> EngineReport:
    return EngineReport("d-1", 3, state, in_flight=in_flight)


READY_NODES = {"a": NodeState.READY, "b": NodeState.READY}


# ---- the rule ----

def test_idle_engine_stops_only_once_the_routers_grace_is_over() -> None:
    r = draining(since=100.0)
    early = drain_verdict(r, 100.0 + GRACE - 0.1, GRACE, READY_NODES, {"a": report(0)})
    assert early.stop == "" and early.wake == 100.0 + GRACE
    done = drain_verdict(r, 100.0 + GRACE, GRACE, READY_NODES, {"a": report(0)})
    assert done.stop.startswith("drained")


def test_busy_or_unknown_engine_waits_for_drain_until() -> None:
    r = draining(since=100.0, timeout=60.0)
    for in_flight in (3, -1):
        v = drain_verdict(r, 130.0, GRACE, READY_NODES, {"a": report(in_flight)})
        assert v.stop == "" and v.wake == 160.0
    assert drain_verdict(r, 130.0, GRACE, READY_NODES, {}).wake == 160.0  # nothing heard
    late = drain_verdict(r, 160.0, GRACE, READY_NODES, {"a": report(3)})
    assert late.stop == "drain_timeout passed with 3 requests still in flight: stopped"
    unknown = drain_verdict(r, 160.0, GRACE, READY_NODES, {"a": report(-1)})
    assert "not known to be done" in unknown.stop


def test_a_drain_timeout_shorter_than_the_grace_wakes_at_drain_until() -> None:
    r = draining(since=100.0, timeout=1.0)
    assert drain_verdict(r, 100.0, GRACE, READY_NODES, {"a": report(0)}).wake == 101.0
    assert drain_verdict(r, 101.0, GRACE, READY_NODES, {"a": report(0)}).stop


def test_a_failure_while_draining_stops_at_once() -> None:
    r = draining(since=100.0, nodes=("a", "b"))
    busy = {"a": report(5), "b": report(-1)}
    assert drain_verdict(r, 101.0, GRACE, READY_NODES, busy).stop == ""
    for state in (EngineState.EXITED, EngineState.FAILED):
        failed = {**busy, "b": evolve(report(-1, state), reason="exited with code 1")}
        v = drain_verdict(r, 101.0, GRACE, READY_NODES, failed)
        assert v.stop == f"engine on b {state} while draining (exited with code 1): stopped"
    lost = drain_verdict(r, 101.0, GRACE, {"a": NodeState.READY, "b": NodeState.LOST}, busy)
    assert lost.stop == "node b lost while draining: stopped"
    assert drain_verdict(r, 101.0, GRACE, {"a": NodeState.READY}, busy).stop  # b gone: lost


def test_unhealthy_or_suspect_is_no_reason_to_cut_streams() -> None:
    # A busy engine's health probe may time out while its streams flow; a suspect node's
    # agent is silent, not its engine. Both wait (bounded by drain_until).
    r = draining(since=100.0)
    sick = {"a": report(2, EngineState.UNHEALTHY)}
    assert drain_verdict(r, 120.0, GRACE, READY_NODES, sick).stop == ""
    assert drain_verdict(r, 120.0, GRACE, {"a": NodeState.SUSPECT}, {"a": report(2)}).stop == ""


def test_only_the_head_engine_says_idle() -> None:
    # Gang members other than rank 0 serve no HTTP: their count is unknown, never zero.
    r = draining(since=100.0, nodes=("a", "b"))
    v = drain_verdict(r, 100.0 + GRACE, GRACE, READY_NODES, {"a": report(0), "b": report(-1)})
    assert v.stop.startswith("drained")


def test_lifecycle_table_drains_only_what_serves() -> None:
    assert DRAINS_FIRST == {S.READY, S.DRAINING}
    assert next_state(S.READY, ReplicaEvent.RETIRE) == S.DRAINING
    assert next_state(S.DRAINING, ReplicaEvent.UNPLACED) == S.PENDING


# ---- through reconcile ----

def idle_reports(w: World, in_flight: int = 0) -> dict[str, list[EngineReport]]:
    return reports_for(w.replicas, in_flight=in_flight)


def test_scale_down_drains_the_replica_then_stops_it_when_idle() -> None:
    w = World(cluster(node("a"), node("b")), dep(2, drain_timeout=60.0))
    w.step()
    w.ready()
    w.deps["d"] = evolve(w.deps["d"], replicas=1)
    res = w.step(idle_reports(w, in_flight=4))
    gone = next(rid for rid, st in w.states().items() if st == S.DRAINING)
    r = w.replicas[gone]
    assert (r.drain_since, r.drain_until) == (w.now, w.now + 60.0)
    assert r.reason == "scaled down to 1; stops once its requests finish, at most 60s"
    assert any(e.replica == gone and e.text == f"draining: {r.reason}" for e in res.events)
    # Its engines stay wanted: nothing is stopped yet, so no node's set changes.
    assert not res.changed_nodes
    assert any(s.replica_id == gone for specs in desired_sets(w.replicas.values()).values()
               for s in specs)
    assert res.next_wake == w.now + GRACE
    # Idle before the grace is over: it stays (a router may not have dropped it yet).
    w.now += 1.0
    assert gone in w.step(idle_reports(w)).replicas
    w.now += GRACE
    res = w.step(idle_reports(w))
    assert gone not in res.replicas and len(res.replicas) == 1
    assert res.changed_nodes  # now its node is told to stop it
    assert any(e.replica == gone and e.text.startswith("drained") for e in res.events)


def test_a_busy_replica_is_stopped_at_drain_until() -> None:
    w = World(cluster(node("a")), dep(1, drain_timeout=30.0))
    w.step()
    w.ready()
    w.deps["d"] = evolve(w.deps["d"], replicas=0)
    w.step(idle_reports(w, in_flight=2))
    assert w.states() == {"d-0": S.DRAINING}
    w.now += GRACE
    res = w.step(idle_reports(w, in_flight=2))
    assert w.states() == {"d-0": S.DRAINING} and res.next_wake == 1030.0
    w.now = 1030.0
    assert w.step(idle_reports(w, in_flight=2)).replicas == {}


def test_a_replica_not_serving_yet_stops_at_once() -> None:
    w = World(cluster(node("a"), node("b")), dep(2, drain_timeout=60.0))
    w.step()  # starting, never ready
    w.deps["d"] = evolve(w.deps["d"], replicas=1)
    res = w.step()
    assert len(res.replicas) == 1 and S.DRAINING not in w.states().values()


def test_delete_drains_every_ready_replica() -> None:
    w = World(cluster(node("a"), node("b")), dep(2, drain_timeout=60.0))
    w.step()
    w.ready()
    del w.deps["d"]
    w.step(idle_reports(w, in_flight=1))
    assert set(w.states().values()) == {S.DRAINING}
    w.now += GRACE
    assert w.step(idle_reports(w)).replicas == {}


def test_drain_timeout_zero_stops_at_once() -> None:
    w = World(cluster(node("a")), dep(1, drain_timeout=0.0))
    w.step()
    w.ready()
    w.deps["d"] = evolve(w.deps["d"], replicas=0)
    assert w.step(idle_reports(w, in_flight=3)).replicas == {}


def test_engine_exit_while_draining_stops_it_without_restart() -> None:
    w = World(cluster(node("a")), dep(1, drain_timeout=60.0))
    w.step()
    w.ready()
    w.deps["d"] = evolve(w.deps["d"], replicas=0)
    w.step(idle_reports(w, in_flight=3))
    res = w.step(reports_for(w.replicas, EngineState.EXITED, exit_code=1))
    assert res.replicas == {}  # gone, not in backoff


def test_node_drain_replaces_first_then_drains_the_old_one() -> None:
    w = World(cluster(node("a"), node("b")), dep(1, drain_timeout=60.0))
    w.step()
    w.ready()
    old = next(iter(w.replicas.values()))
    w.set_node(old.members[0].node_id, draining=True, cordoned=True)
    w.step(idle_reports(w, in_flight=2))
    assert w.states()[old.id] == S.READY  # serves until its replacement does
    w.step(idle_reports(w, in_flight=2))  # the replacement is ready now
    assert w.states()[old.id] == S.DRAINING
    w.now += GRACE
    w.step(idle_reports(w))
    assert old.id not in w.replicas and w.states() and set(w.states().values()) == {S.READY}


def test_rolling_update_drains_the_replaced_one() -> None:
    w = World(cluster(node("a"), node("b")), dep(1, drain_timeout=60.0))
    w.step()
    w.ready()
    w.deps["d"] = evolve(w.deps["d"], args=("--new",))
    w.step(idle_reports(w, in_flight=1))  # surge placed
    w.step(idle_reports(w, in_flight=1))  # surge ready: the old one drains
    assert sorted(w.states().values()) == [S.DRAINING, S.READY]
    w.now += GRACE
    w.step(idle_reports(w))
    assert [r.spec.args for r in w.replicas.values()] == [("--new",)]


def test_rolling_update_without_room_drains_before_the_new_one_starts() -> None:
    w = World(cluster(node("a")), dep(1, drain_timeout=60.0))
    w.step()
    w.ready()
    w.deps["d"] = evolve(w.deps["d"], args=("--new",))
    w.step(idle_reports(w, in_flight=1))
    states = w.states()
    assert sorted(states.values()) == [S.DRAINING, S.PENDING]  # the old one serves its last
    w.now += GRACE
    w.step(idle_reports(w))
    (r,) = w.replicas.values()
    assert r.state == S.STARTING and r.spec.args == ("--new",)


def test_a_draining_replica_is_no_slot() -> None:
    # Scaled down, then up again while it drains: a new replica is made; the draining
    # one still leaves (it holds its GPUs until then).
    w = World(cluster(node("a"), node("b")), dep(1, drain_timeout=60.0))
    w.step()
    w.ready()
    w.deps["d"] = evolve(w.deps["d"], replicas=0)
    w.step(idle_reports(w, in_flight=1))
    w.deps["d"] = evolve(w.deps["d"], replicas=1)
    w.step(idle_reports(w, in_flight=1))
    assert sorted(w.states().values()) == [S.DRAINING, S.STARTING]


def test_retired_with_its_engine_already_gone_it_stops_at_once() -> None:
    # Its node went suspect (so the exit was not acted on), then it was deleted: nothing
    # is left to drain. (Found by the model-based test: a full pass and an incremental
    # one disagreed on it.)
    w = World(cluster(node("a")), dep(1, drain_timeout=60.0))
    w.step()
    w.ready()
    w.set_node("a", state=NodeState.SUSPECT, silent_since=w.now)
    del w.deps["d"]
    res = w.step(reports_for(w.replicas, EngineState.EXITED, exit_code=1))
    assert res.replicas == {}
    assert any(e.text.startswith("engine on a exited while draining") for e in res.events)

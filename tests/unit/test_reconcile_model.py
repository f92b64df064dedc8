"""A model-based test of the pure cores: reconcile, placement and the replica lifecycle
table, under random sequences of operator and node events.

A hypothesis state machine plays the operator (apply, spec change, scale, delete, cordon,
uncordon, drain), the nodes (ready, suspect, lost, back) and their agents (which run
exactly their desired set, and whose engines start, become ready, exit or turn
unhealthy, and report how many requests they have in flight), and time. Stops that are
no failure drain (drain_timeout 60 s, or 0: at once). After every pass it checks what must always hold; `settle` then
checks what must hold after quiet time with room enough.

Passes run as the server runs them: incrementally, on one ReconcileState kept across
passes and fed deltas (what changed of the nodes, their reports and the deployments).
After each, a full pass from a snapshot of the same inputs must change nothing (so the
incremental pass missed nothing a full one would have done), and the state's index and
maps must equal those built from scratch.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
from attrs import evolve
from attrs import fields_dict as _fields_dict
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fakes.cluster import node
from llmgw.model.deployment import Deployment, Replica, ReplicaState
from llmgw.model.engine import EngineKind, EngineReport, EngineState
from llmgw.model.node import NodeState
from llmgw.server.placement.place import ClusterView, NodeView
from llmgw.server.reconcile.rules import (
    NodeDelta,
    ReconcileSettings,
    ReconcileState,
    desired_sets,
    reconcile,
    reconcile_dirty,
)

S = ReplicaState
NODES = ("a", "b")
NAMES = ("x", "y")
GPUS_PER_NODE = 2
SETTINGS = ReconcileSettings(backoff_base=5.0, backoff_cap=40.0, stable_after=30.0, grace_period=60.0)


def spec(name: str, replicas: int, variant: int, drain_timeout: float = 60.0) -> Deployment:
    return Deployment(name=name, model=f"org/{name}", engine=EngineKind.VLLM, gpus_per_node=1,
                      replicas=replicas, args=(f"--variant={variant}",), drain_timeout=drain_timeout)


class Cluster(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.views: dict[str, NodeView] = {n: node(n, GPUS_PER_NODE, fabrics=("ib-a",)) for n in NODES}
        self.deps: dict[str, Deployment] = {}
        self.replicas: dict[str, Replica] = {}
        self.floor = 0
        # What each node's agent runs: (replica id, generation) -> the engine's state.
        self.engines: dict[str, dict[tuple[str, int], EngineState]] = {n: {} for n in NODES}
        # Requests each engine reports in flight (absent: -1, not known).
        self.in_flight: dict[tuple[str, int], int] = {}
        # What each engine reports of its pre-flight (issue 22; absent: none asked).
        self.probes: dict[tuple[str, int], str] = {}
        self.pending: dict[str, str] = {}
        # Whether the last event may lower the ready count (scale-down, loss, failures,
        # a spec change that has no room to surge), and the count before it.
        self.may_drop = False
        self.ready_before: dict[str, int] = {}
        # The server's side: one state across passes, and what it was last told.
        self.state = ReconcileState(stable_after=SETTINGS.stable_after)
        self.told_nodes: dict[str, NodeDelta] = {}
        self.told_deps: dict[str, Deployment] = {}

    # ---- the pass, and the agents following their desired sets ----

    def tell(self) -> None:
        """Deltas, as the orchestrator sends them: only what changed since last told."""
        for n, v in self.views.items():
            delta = NodeDelta(n, v, tuple(
                EngineReport(rid, gen, st, in_flight=self.in_flight.get((rid, gen), -1),
                             preflight=self.probes.get((rid, gen), ""))
                for (rid, gen), st in sorted(self.engines[n].items())))
            if self.told_nodes.get(n) != delta:
                self.state.node(delta)
                self.told_nodes[n] = delta
        for name in self.deps.keys() | self.told_deps.keys():
            if self.deps.get(name) != self.told_deps.get(name):
                self.state.deployment_changed(name)
        self.told_deps = dict(self.deps)

    def run_pass(self) -> None:
        self.tell()
        res = reconcile_dirty(self.state, self.deps, self.now, SETTINGS, self.floor)
        assert res.generation_floor >= self.floor
        self.replicas, self.floor, self.pending = res.replicas, res.generation_floor, res.pending
        self.check_state()
        sets = desired_sets(self.replicas.values(), NODES)
        for n in NODES:
            if self.views[n].state == NodeState.LOST:
                continue  # cut off: it hears nothing, its engines run on
            wanted = {(s.replica_id, s.generation) for s in sets[n]}
            self.engines[n] = {k: st for k, st in self.engines[n].items() if k in wanted}
            for k in wanted:
                self.engines[n].setdefault(k, EngineState.STARTING)

    def check_state(self) -> None:
        """A full pass over the same inputs changes nothing; the state is as if fresh."""
        reports = {n: d.reports for n, d in self.told_nodes.items()}
        full = reconcile(self.deps, self.replicas, self.views, reports, self.now, SETTINGS, self.floor)
        diff = {rid: _fields_apart(full.replicas.get(rid), self.replicas.get(rid))
                for rid in sorted(full.replicas.keys() | self.replicas.keys())
                if full.replicas.get(rid) != self.replicas.get(rid)}
        assert not diff, diff
        fresh = ReconcileState(self.views, self.replicas, reports, stable_after=SETTINGS.stable_after)
        for attr in ("on_node", "of_deployment", "unplaced", "silent", "draining", "replicas"):
            assert getattr(self.state, attr) == getattr(fresh, attr), attr
        # A draining replica's timer: a fresh state looks first when the routers' grace
        # ends, and that look moves it on to drain_until, where the kept one may be now.
        timed = dict(self.state.timed)
        for rid, t in fresh.timed.items():
            r = self.replicas[rid]
            if r.state == S.DRAINING and timed.get(rid) == r.drain_until:
                timed[rid] = t
        assert timed == fresh.timed
        if self.state.indexed:
            assert self.state.view(self.replicas).content() == fresh.view(self.replicas).content()
        else:
            ClusterView(self.views)  # nothing to compare: it is built on first need

    def ready_counts(self) -> dict[str, int]:
        return dict(Counter(r.deployment for r in self.replicas.values() if r.state == S.READY))

    def event(self, *, may_drop: bool) -> None:
        self.ready_before = self.ready_counts()
        # A failure the server has not heard of yet (its node was suspect) counts when heard.
        unheard = any(st != EngineState.READY and st != EngineState.STARTING
                      for engines in self.engines.values() for st in engines.values())
        # A rolling update still under way may take one replica down where it has no
        # room to surge (down then up), in any later pass.
        rolling = any(r.deployment in self.deps
                      and r.spec.template_hash() != self.deps[r.deployment].template_hash()
                      for r in self.replicas.values())
        self.may_drop = may_drop or unheard or rolling
        self.run_pass()

    # ---- operator ----

    @rule(name=st.sampled_from(NAMES), replicas=st.integers(0, 4), variant=st.integers(0, 1),
          drain_timeout=st.sampled_from([60.0, 0.0]))
    def apply(self, name: str, replicas: int, variant: int, drain_timeout: float) -> None:
        old = self.deps.get(name)
        self.deps[name] = spec(name, replicas, variant, drain_timeout)
        may_drop = old is not None and (replicas < old.replicas or old.args != self.deps[name].args)
        self.event(may_drop=may_drop)

    @precondition(lambda self: bool(self.deps))
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        del self.deps[data.draw(st.sampled_from(sorted(self.deps)))]
        self.event(may_drop=True)

    @rule(n=st.sampled_from(NODES), how=st.sampled_from(["cordon", "drain", "uncordon"]))
    def cordon(self, n: str, how: str) -> None:
        self.views[n] = evolve(self.views[n], cordoned=how != "uncordon", draining=how == "drain")
        self.event(may_drop=False)

    @rule(n=st.sampled_from(NODES))
    def drain_and_return(self, n: str) -> None:
        """An operator drains a node for maintenance and puts it back after the drain ran."""
        self.cordon(n, "drain")
        self.settle_engines()
        self.cordon(n, "uncordon")

    # ---- nodes ----

    @rule(n=st.sampled_from(NODES), state=st.sampled_from(list(NodeState)))
    def node_state(self, n: str, state: NodeState) -> None:
        v = self.views[n]
        silent = None if state == NodeState.READY else (v.silent_since or self.now)
        self.views[n] = evolve(v, state=state, silent_since=silent)
        self.event(may_drop=state == NodeState.LOST)

    # ---- engines ----

    @rule(data=st.data(), state=st.sampled_from([EngineState.READY, EngineState.EXITED,
                                                 EngineState.UNHEALTHY, EngineState.FAILED]))
    def engine(self, data: st.DataObject, state: EngineState) -> None:
        running = [(n, k) for n in NODES for k in self.engines[n]]
        if not running:
            return
        n, k = data.draw(st.sampled_from(sorted(running)))
        self.engines[n][k] = state
        self.event(may_drop=state != EngineState.READY)

    @rule(data=st.data(), outcome=st.sampled_from(["running", "running-live", "passed", "slow",
                                                   "timeout"]))
    def probe(self, data: st.DataObject, outcome: str) -> None:
        """An engine's launcher runs the pre-flight (issue 22): still running, passed, or
        failed (too slow, or timed out): the launcher exits 3 without starting the engine.
        running-live: a member watched for liveness only, reported ready while its
        launcher still probes. A member lost mid-probe is node_state's LOST while one runs."""
        starting = sorted((n, k) for n in NODES for k, st in self.engines[n].items()
                          if st == EngineState.STARTING)
        if not starting:
            return
        n, k = data.draw(st.sampled_from(starting))
        if outcome == "running-live":
            self.engines[n][k] = EngineState.READY
        if outcome in ("running", "running-live", "passed"):
            self.probes[k] = "passed: gloo x2, in 1.0s" if outcome == "passed" else "running"
            self.event(may_drop=False)
            return
        self.probes[k] = ("failed: bus bandwidth 0.4 GB/s is below 10 GB/s" if outcome == "slow"
                          else "failed: timed out after 60s")
        self.engines[n][k] = EngineState.EXITED
        self.event(may_drop=True)

    @rule(data=st.data(), count=st.sampled_from([0, 2, -1]))
    def requests(self, data: st.DataObject, count: int) -> None:
        """An engine's agent reports its in-flight count: none, some, or not known."""
        running = sorted(k for n in NODES for k in self.engines[n])
        if not running:
            return
        self.in_flight[data.draw(st.sampled_from(running))] = count
        self.event(may_drop=False)

    @rule(seconds=st.sampled_from([1.0, 5.0, 10.0, 60.0, 300.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self.event(may_drop=False)

    # ---- after quiet time ----

    def settle_engines(self, passes: int = 12) -> None:
        """Engines come up and backoffs end, pass after pass."""
        for _ in range(passes):
            self.run_pass()
            for n in NODES:
                for k in self.engines[n]:
                    self.engines[n][k] = EngineState.READY
                    if self.probes.get(k) == "running":
                        self.probes[k] = "passed: gloo x2, in 1.0s"
            self.now += SETTINGS.backoff_cap + 1
        self.run_pass()

    @rule()
    def settle(self) -> None:
        """Every node back and ready, engines come up, backoffs end: the cluster converges."""
        for n in NODES:
            self.views[n] = evolve(self.views[n], state=NodeState.READY, silent_since=None)
        self.settle_engines()
        self.ready_before, self.may_drop = self.ready_counts(), True
        schedulable = sum(GPUS_PER_NODE for v in self.views.values() if not v.cordoned)
        if sum(d.replicas for d in self.deps.values()) > schedulable:
            return
        assert not self.pending, self.pending
        for name, d in self.deps.items():
            mine = [r for r in self.replicas.values() if r.deployment == name]
            assert len(mine) == d.replicas, (name, [r.id for r in mine])
            assert all(r.state == S.READY for r in mine), [(r.id, r.state) for r in mine]
            assert all(r.spec.template_hash() == d.template_hash() for r in mine)
            assert not any(r.replaces for r in mine)
            assert not any(self.views[m].draining for r in mine for m in r.node_ids)
        assert {r.deployment for r in self.replicas.values()} <= set(self.deps)

    def teardown(self) -> None:
        # Every run ends with quiet time, so each one is also checked for convergence.
        self.settle()

    # ---- what always holds ----

    @invariant()
    def nothing_serves_before_its_probe_passed(self) -> None:
        """A replica whose member the server heard running its probe is not READY; one in
        PREFLIGHT has such a member (or one whose node it cannot hear)."""
        for r in self.replicas.values():
            heard = [self.probes.get((r.id, r.generation), "") == "running"
                     and self.views[m].state == NodeState.READY for m in r.node_ids]
            if any(heard):
                assert r.state not in (S.READY, S.UNHEALTHY, S.DRAINING), (r.id, r.state)
            if r.state == S.PREFLIGHT:
                assert any(heard) or any(self.views[m].state != NodeState.READY
                                         for m in r.node_ids), r.id

    @invariant()
    def no_gpu_or_port_twice(self) -> None:
        gpus: Counter[tuple[str, str]] = Counter()
        ports: Counter[tuple[str, int]] = Counter()
        for r in self.replicas.values():
            for m in r.members:
                gpus.update((m.node_id, g) for g in m.gpus)
                ports.update((m.node_id, p) for p in m.bound_ports())
        assert not [k for k, c in gpus.items() if c > 1], gpus
        assert not [k for k, c in ports.items() if c > 1], ports

    @invariant()
    def one_generation_per_replica_in_desired_sets(self) -> None:
        seen: dict[str, set[int]] = {}
        for specs in desired_sets(self.replicas.values()).values():
            for s in specs:
                seen.setdefault(s.replica_id, set()).add(s.generation)
        assert all(len(g) == 1 for g in seen.values()), seen

    @invariant()
    def ready_never_drops_without_cause(self) -> None:
        if self.may_drop:
            return
        now = self.ready_counts()
        for name, before in self.ready_before.items():
            d = self.deps.get(name)
            if d is not None:
                assert now.get(name, 0) >= min(d.replicas, before), (name, before, now)

    @invariant()
    def draining_is_bounded(self) -> None:
        """A draining replica never outlives its drain_until, and one whose engine said it
        is idle is gone once the routers' grace is over (unless its node went silent)."""
        for r in self.replicas.values():
            if r.state != S.DRAINING:
                continue
            assert r.drain_since <= self.now < r.drain_until, (r.id, r.drain_since, r.drain_until)
            head = r.members[0]
            idle = self.in_flight.get((r.id, r.generation)) == 0
            heard = self.views[head.node_id].state == NodeState.READY
            assert not (idle and heard and self.now >= r.drain_since + SETTINGS.drain_grace), r.id

    @invariant()
    def replacements_point_at_replicas_of_their_deployment(self) -> None:
        for r in self.replicas.values():
            if r.replaces:
                old = self.replicas.get(r.replaces)
                assert old is None or old.deployment == r.deployment


def attrs_fields(cls: type) -> list[str]:
    return list(_fields_dict(cls))


def _fields_apart(a: Replica | None, b: Replica | None) -> object:
    """What a full pass would change of a replica: (field, full's, incremental's)."""
    if a is None or b is None:
        return (a and a.state, b and b.state)
    return [(f, getattr(a, f), getattr(b, f)) for f in attrs_fields(Replica)
            if getattr(a, f) != getattr(b, f)]


EXAMPLES = int(os.environ.get("LLMGW_MODEL_EXAMPLES", "60"))

TestCluster = Cluster.TestCase
TestCluster.settings = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
                                database=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.long
def test_model_long() -> None:
    """The same machine, many more and longer runs (`pytest -m long`; .ci/run runs it)."""
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(Cluster, settings=settings(
        max_examples=max(EXAMPLES, 600), stateful_step_count=80, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow]))

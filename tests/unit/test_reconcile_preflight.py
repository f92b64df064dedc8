"""A gang whose pre-flight failed (issue 22, server side): low bandwidth or a hang reported
by the members' launchers (model/preflight.py) -> the replica is placed again at once on
other nodes, which new gangs avoid for a while; a member lost mid-probe -> re-placed
without it; any other exit is the usual backoff."""

from __future__ import annotations

from collections.abc import Iterable

from test_reconcile import dep

from fakes.cluster import cluster, node
from llmgw.model.deployment import Replica, ReplicaState
from llmgw.model.engine import EngineReport, EngineState
from llmgw.model.node import NodeState
from llmgw.model.preflight import AVOID_SECONDS, EXIT_CODE, FAILED_LINE, failure
from llmgw.server.reconcile.rules import NodeDelta, ReconcileResult, ReconcileState, reconcile_dirty

S = ReplicaState
SLOW = "bus bandwidth 0.4 GB/s is below 10 GB/s"


class Kept:
    """The server's way: one ReconcileState fed node deltas, a pass after each."""

    def __init__(self, *names: str) -> None:
        self.nodes = cluster(*(node(n, 2, fabrics=["ib"]) for n in names))
        self.state = ReconcileState(self.nodes)
        self.deps = {"d": dep(1, gpus=1, nodes=2)}
        self.now = 1000.0
        self.res: ReconcileResult = reconcile_dirty(self.state, self.deps, self.now)

    @property
    def r(self) -> Replica:
        return self.state.replicas["d-0"]

    def report(self, state: EngineState, nodes: Iterable[str] | None = None, **kw: object) -> None:
        r = self.r
        for m in r.members:
            if nodes is None or m.node_id in nodes:
                rep = EngineReport(replica_id=r.id, generation=r.generation, state=state, **kw)  # type: ignore[arg-type]
                self.state.node(NodeDelta(m.node_id, self.nodes[m.node_id], (rep,)))
        self.step()

    def step(self, dt: float = 1.0) -> None:
        self.now += dt
        self.res = reconcile_dirty(self.state, self.deps, self.now)


def preflight_tail(why: str) -> tuple[str, ...]:
    return ("llmgw launcher: pre-flight: python probe.py (at most 60s)", f"{FAILED_LINE}{why}",
            "llmgw launcher: pre-flight is required: the engine does not start")


def test_the_launchers_line_is_read_back() -> None:
    assert failure(EXIT_CODE, preflight_tail(SLOW)) == SLOW
    assert failure(1, preflight_tail(SLOW)) == ""  # another exit: not a pre-flight's
    assert failure(EXIT_CODE, ("Traceback ...",)) == ""


def test_low_bandwidth_places_the_gang_on_another_pair_and_avoids_the_first() -> None:
    k = Kept("a", "b", "c", "d")
    first, gen = set(k.r.node_ids), k.r.generation
    k.report(EngineState.EXITED, exit_code=EXIT_CODE, log_tail=preflight_tail(SLOW))
    r = k.r
    assert r.placed and r.generation > gen and set(r.node_ids).isdisjoint(first)
    assert r.state == S.STARTING and r.restarts == 1
    pair = ", ".join(sorted(first))
    assert any(e.text.startswith(f"pre-flight failed on {pair} (fabric ib): {SLOW}; avoiding them for")
               for e in k.res.events), [e.text for e in k.res.events]
    assert f"{FAILED_LINE}{SLOW}" in r.last_log_tail  # describe shows the members' own words
    # It starts on the second pair: ready, and the avoidance lapses in time.
    k.report(EngineState.READY)
    assert k.r.state == S.READY
    assert set(k.state.avoid) == first
    k.step(AVOID_SECONDS + 1)
    k.deps = {"d": dep(2, gpus=1, nodes=2)}
    k.state.deployment_changed("d")
    k.step()
    assert set(k.state.replicas["d-1"].node_ids) == first and not k.state.avoid


def test_a_hang_with_nowhere_else_waits_until_the_nodes_may_be_tried_again() -> None:
    k = Kept("a", "b")
    k.report(EngineState.EXITED, exit_code=EXIT_CODE, log_tail=preflight_tail("timed out after 60s"))
    r = k.r
    assert not r.placed and r.state == S.PENDING and r.restarts == 1
    assert r.reason.endswith("2 were excluded"), r.reason
    k.step(AVOID_SECONDS + 1)
    assert k.r.placed and sorted(k.r.node_ids) == ["a", "b"]


def test_a_member_lost_mid_probe_is_placed_again_without_it() -> None:
    k = Kept("a", "b", "c")
    lost = k.r.node_ids[1]
    k.nodes[lost] = k.nodes[lost].__class__(**{**{f: getattr(k.nodes[lost], f) for f in
                                                   ("info", "inventory")}, "state": NodeState.LOST})
    k.state.node(NodeDelta(lost, k.nodes[lost], ()))
    k.step()
    assert k.r.placed and lost not in k.r.node_ids


def test_other_exits_back_off_as_before_and_repeats_end_in_a_crash_loop() -> None:
    k = Kept("a", "b", "c", "d")
    k.report(EngineState.EXITED, exit_code=1, log_tail=("Traceback (most recent call last):",))
    assert k.r.state == S.BACKOFF and not k.state.avoid
    # Pre-flights failing pair after pair: re-placed at once twice, the third failure
    # (crashloop_after) is a crash loop like any other, not an endless walk over pairs.
    k2 = Kept(*"abcdefgh")
    seen = []
    for _ in range(3):
        assert k2.r.state == S.STARTING
        seen.append(frozenset(k2.r.node_ids))
        k2.report(EngineState.EXITED, exit_code=EXIT_CODE, log_tail=preflight_tail(SLOW))
    assert k2.r.state == S.CRASH_LOOPING and k2.r.restarts == 3
    assert len(set(seen)) == 3 and set(k2.state.avoid) == set().union(*seen[:2])

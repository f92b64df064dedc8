"""The pre-flight as a step of the replica lifecycle (issue 22): PREFLIGHT between placed
and starting, driven by what the members report of their probe (EngineReport.preflight),
through the replica table and reconcile; describe's per-member figures and the last
figures per fabric (status.py), as plain data."""

from __future__ import annotations

import json

import pytest
from attrs import evolve
from test_reconcile_preflight import SLOW, Kept, preflight_tail

from llmgw.agent.lifecycle.preflight_report import Reported, parse_result
from llmgw.model.deployment import ReplicaState
from llmgw.model.engine import EngineReport, EngineState
from llmgw.model.node import NodeState
from llmgw.model.preflight import EXIT_CODE
from llmgw.server.reconcile.replica_states import (
    InvalidReplicaTransition,
    ReplicaEvent,
    engines_event,
    next_state,
)
from llmgw.server.reconcile.rules import NodeDelta
from llmgw.server.status import fabric_preflight, member_preflight

S = ReplicaState
E = ReplicaEvent
ES = EngineState
PASSED = "passed: gloo x2, 4 MiB at 1.15 GB/s bus bandwidth, in 2.0s"


def test_the_table_has_the_step_between_placed_and_starting() -> None:
    assert next_state(S.STARTING, E.PREFLIGHT_RUNNING) == S.PREFLIGHT
    assert next_state(S.PREFLIGHT, E.PREFLIGHT_RUNNING) == S.PREFLIGHT
    assert next_state(S.PREFLIGHT, E.ENGINES_STARTING) == S.STARTING
    assert next_state(S.PREFLIGHT, E.FAILED) == S.BACKOFF
    assert next_state(S.PREFLIGHT, E.UNPLACED) == S.PENDING
    assert next_state(S.PREFLIGHT, E.NODE_LOST_HELD) == S.HELD
    with pytest.raises(InvalidReplicaTransition):
        next_state(S.READY, E.PREFLIGHT_RUNNING)  # a serving replica's probes are long over
    with pytest.raises(InvalidReplicaTransition):
        next_state(S.PREFLIGHT, E.RETIRE)  # serves nothing: stopped at once, no drain


def test_engines_event_waits_on_a_running_probe() -> None:
    run, ok = "running", PASSED
    # A liveness-only member is ready while its launcher still probes: not ready yet.
    assert engines_event(S.STARTING, [ES.STARTING, ES.READY], [run, run]) == E.PREFLIGHT_RUNNING
    assert engines_event(S.PREFLIGHT, [ES.STARTING, ES.READY], [ok, run]) == E.PREFLIGHT_RUNNING
    assert engines_event(S.PREFLIGHT, [ES.STARTING, ES.READY], [ok, ok]) == E.ENGINES_STARTING
    assert engines_event(S.PREFLIGHT, [ES.READY, ES.READY], [ok, ok]) == E.ENGINES_READY
    # A failure is a failure, probe or not; a suspect member's old word is not news.
    assert engines_event(S.PREFLIGHT, [ES.EXITED, ES.READY], ["failed: x", run]) == E.FAILED
    assert engines_event(S.PREFLIGHT, [None, ES.STARTING], [run, ok]) is None
    # No probe asked (every other deployment): as before.
    assert engines_event(S.STARTING, [ES.READY, ES.READY]) == E.ENGINES_READY
    assert engines_event(S.READY, [ES.READY], [run]) == E.ENGINES_READY


def test_a_gang_waits_in_preflight_until_every_member_passed() -> None:
    k = Kept("a", "b")
    assert k.r.state == S.STARTING
    head, other = k.r.node_ids
    k.report(ES.STARTING, preflight="running")
    assert k.r.state == S.PREFLIGHT
    assert any(e.text == f"pre-flight: the probe runs on {head}, {other}" for e in k.res.events)
    k.report(ES.STARTING, nodes=[head], preflight=PASSED, preflight_busbw_gbps=1.15)
    assert k.r.state == S.PREFLIGHT  # the other still probes
    k.report(ES.READY, nodes=[other], preflight="running")  # liveness only: ready at once
    assert k.r.state == S.PREFLIGHT
    k.report(ES.READY, nodes=[other], preflight=PASSED, preflight_busbw_gbps=1.15)
    assert k.r.state == S.STARTING
    assert any(e.text == f"pre-flight {head} {PASSED}; {other} {PASSED}" for e in k.res.events)
    k.report(ES.READY, nodes=[head], preflight=PASSED, preflight_busbw_gbps=1.15)
    assert k.r.state == S.READY


def test_a_failed_probe_from_preflight_places_the_gang_elsewhere() -> None:
    k = Kept("a", "b", "c", "d")
    first = set(k.r.node_ids)
    k.report(ES.STARTING, preflight="running")
    assert k.r.state == S.PREFLIGHT
    k.report(ES.EXITED, exit_code=EXIT_CODE, log_tail=preflight_tail(SLOW), preflight=f"failed: {SLOW}")
    assert k.r.state == S.STARTING and set(k.r.node_ids).isdisjoint(first)
    assert set(k.state.avoid) == first


def test_a_member_lost_during_the_probe_is_placed_again() -> None:
    k = Kept("a", "b", "c")
    k.report(ES.STARTING, preflight="running")
    lost = k.r.node_ids[1]
    k.state.node(_delta(k, lost, NodeState.LOST))
    k.step()
    assert lost not in k.r.node_ids and k.r.state == S.STARTING


def _delta(k: Kept, node_id: str, state: NodeState) -> NodeDelta:
    k.nodes[node_id] = evolve(k.nodes[node_id], state=state, silent_since=k.now)
    return NodeDelta(node_id, k.nodes[node_id], ())


def _passed(k: Kept, busbw: tuple[float, float]) -> dict[str, EngineReport]:
    r = k.r
    return {m.node_id: EngineReport(r.id, r.generation, ES.READY, preflight=PASSED,
                                    preflight_busbw_gbps=b)
            for m, b in zip(r.members, busbw, strict=True)}


def test_describe_and_the_fabrics_figures_from_the_members_reports() -> None:
    k = Kept("a", "b")
    r = k.r
    reports = _passed(k, (1.3, 1.15))
    assert member_preflight(r, reports) == {n: PASSED for n in r.node_ids}
    got = fabric_preflight([(r, reports)])
    assert got == {"ib": {"replica": r.id, "busbw_gbps": 1.15,
                          "members": {n: PASSED for n in r.node_ids}}}
    # Not every member passed (one still runs, or never asked): no figures from it.
    running = {**reports, r.node_ids[1]: evolve(reports[r.node_ids[1]], preflight="running")}
    assert fabric_preflight([(r, running)]) == {}
    assert fabric_preflight([(r, {r.node_ids[0]: reports[r.node_ids[0]]})]) == {}
    # Of two replicas on the fabric, the one placed last.
    later = evolve(r, id="d-9", placed_at=r.placed_at + 5)
    slow = {n: evolve(x, replica_id="d-9", preflight_busbw_gbps=0.5) for n, x in reports.items()}
    assert fabric_preflight([(later, slow), (r, reports)])["ib"]["busbw_gbps"] == 0.5


def test_the_agent_reads_the_launchers_result() -> None:
    ok = {"ok": True, "line": PASSED, "results": [
        {"bytes": 65536, "busbw_gbps": 0.2}, {"bytes": 4 << 20, "busbw_gbps": 1.15}]}
    assert parse_result(json.dumps(ok)) == Reported(PASSED, 1.15)
    bad = {"ok": False, "line": f"failed: {SLOW}", "results": []}
    assert parse_result(json.dumps(bad)) == Reported(f"failed: {SLOW}", 0.0)
    assert parse_result("{").line.startswith("failed: unreadable result")
    assert parse_result("[]").line.startswith("failed: unreadable result")


def test_ctl_shows_the_members_and_the_fabrics_figures() -> None:
    from llmgw.ctl.render import _describe_replica, fabric_preflight_lines, render_status

    r = {"id": "g-0", "deployment": "g", "state": "preflight", "nodes": ["a", "b"],
         "preflight": {"b": "running", "a": PASSED}}
    text = _describe_replica(r)
    assert f"Pre-flight:\n  a: {PASSED}\n  b: running" in text
    figs = {"ib": {"replica": "g-0", "busbw_gbps": 1.15, "members": {"b": PASSED, "a": PASSED}}}
    line = "pre-flight on ib: 1.15 GB/s bus bandwidth (slowest member of g-0, a, b)"
    assert fabric_preflight_lines(figs) == [line]
    assert line in render_status({"nodes": [], "fabrics": [], "preflight": figs})
    assert fabric_preflight_lines({}) == [] and fabric_preflight_lines(None) == []

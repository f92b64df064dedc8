"""The replica and node lifecycle tables: one API (TRANSITIONS, next_state, a typed error),
the named groups derived from or agreeing with the table, births, and the rules from the
members' engine states to a replica event (the engine table: test_engine_states.py)."""

from __future__ import annotations

import itertools

import pytest

from llmgw.errors import LlmgwError
from llmgw.model.deployment import Deployment, Member, Replica, ReplicaState
from llmgw.model.engine import EngineKind, EngineState
from llmgw.model.node import NodeState
from llmgw.server.peers import node_states
from llmgw.server.reconcile import replica_states
from llmgw.server.reconcile.replica_states import (
    BACKING_OFF,
    ROUTABLE,
    WANTS_ENGINES,
    InvalidReplicaTransition,
    ReplicaEvent,
    engines_event,
)

S, E, ES = ReplicaState, ReplicaEvent, EngineState


def test_node_table_is_total() -> None:
    for state, event in itertools.product(NodeState, node_states.NodeEvent):
        assert node_states.next_state(state, event) == node_states.TRANSITIONS[state, event]
    assert node_states.next_state(NodeState.LOST, node_states.NodeEvent.HEARD) == NodeState.READY


def test_node_error_is_typed() -> None:
    err = node_states.InvalidNodeTransition(NodeState.READY, node_states.NodeEvent.GONE)
    assert isinstance(err, LlmgwError)
    assert str(err) == "node event 'gone' is not valid in state 'ready'"


def test_replica_births() -> None:
    assert replica_states.next_state(None, E.ADOPTED) == S.STARTING
    # The only way to be born other than PENDING (the model's default) is a named pair.
    assert {e for (s, e) in replica_states.TRANSITIONS if s is None} == {E.ADOPTED}
    with pytest.raises(InvalidReplicaTransition, match="'placed' is not valid in state 'not yet known'"):
        replica_states.next_state(None, E.PLACED)
    with pytest.raises(InvalidReplicaTransition):
        replica_states.next_state(S.READY, E.ADOPTED)


def test_replica_groups_agree_with_the_table() -> None:
    # Backing off: only RESTART (or being taken off its nodes) moves it.
    for s in BACKING_OFF:
        assert {e for (st, e) in replica_states.TRANSITIONS if st == s} == {E.RESTART, E.UNPLACED}
    assert not BACKING_OFF & WANTS_ENGINES
    # What routers list has engines; HELD and UNHEALTHY can turn ready again.
    assert ROUTABLE <= WANTS_ENGINES
    for s in ROUTABLE:
        assert replica_states.next_state(s, E.ENGINES_READY) == S.READY
    assert S.DRAINING not in ROUTABLE and S.STARTING not in ROUTABLE


def test_the_models_wants_engines_is_the_tables() -> None:
    """Replica.wants_engines (the model cannot import the table) names the same states."""
    spec = Deployment(name="d", model="org/m", engine=EngineKind.VLLM, gpus_per_node=1, replicas=1)
    for state in S:
        r = Replica(id="d-0", deployment="d", index=0, spec=spec, state=state,
                    members=(Member(node_id="a", rank=0, gpus=(), port=1),))
        assert r.wants_engines == (state in WANTS_ENGINES), state


R, U, ST, X, F = ES.READY, ES.UNHEALTHY, ES.STARTING, ES.EXITED, ES.FAILED


@pytest.mark.parametrize(
    ("state", "members", "event"),
    [
        (S.STARTING, [R, R], E.ENGINES_READY),
        (S.READY, [R], E.ENGINES_READY),
        (S.STARTING, [R, ST], E.ENGINES_STARTING),
        (S.READY, [R, U], E.ENGINE_UNHEALTHY),
        (S.READY, [None, U], E.ENGINE_UNHEALTHY),  # unhealthy heard beside a suspect node
        (S.READY, [R, X], E.FAILED),
        (S.STARTING, [F, U], E.FAILED),  # a failure outweighs anything else heard
        (S.READY, [R, None], None),  # a suspect node: no news, no change
        (S.READY, [None], None),
        (S.HELD, [R, None], E.NODE_BACK),
        (S.HELD, [None, None], E.NODE_BACK),
        (S.HELD, [R, R], E.ENGINES_READY),
    ],
)
def test_engines_event(state: ReplicaState, members: list[EngineState | None],
                       event: ReplicaEvent | None) -> None:
    assert engines_event(state, members) == event


def test_engines_events_are_valid_where_reconcile_asks() -> None:
    """Reconcile asks only for a placed replica outside backoff and drain: whatever the
    members say, the event is one the table accepts there."""
    values = [None, *ES]
    for state in (S.STARTING, S.READY, S.UNHEALTHY, S.HELD):
        for members in itertools.product(values, repeat=2):
            event = engines_event(state, list(members))
            # FAILED is counted first: CRASH_LOOP past the threshold, else FAILED itself.
            for e in () if event is None else (event, E.CRASH_LOOP) if event == E.FAILED else (event,):
                replica_states.next_state(state, e)

"""The replica and node lifecycle tables: one API (TRANSITIONS, next_state, a typed error),
the named groups derived from or agreeing with the table, births, and the rules from the
members' engine states to a replica event (the engine table: test_engine_states.py)."""

from __future__ import annotations

import itertools

import pytest

from llmgw.errors import InternalError, LlmgwError
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


def test_node_births() -> None:
    """A node first heard is born ready; one the store remembers is born suspect."""
    assert node_states.born(node_states.NodeBirth.JOINED) == NodeState.READY
    assert node_states.born(node_states.NodeBirth.REMEMBERED) == NodeState.SUSPECT
    assert set(node_states.BIRTHS) == set(node_states.NodeBirth)


def test_node_restart_grace_makes_silence_suspect_never_lost() -> None:
    silence = node_states.silence_event
    assert silence(5.0, 15.0, 60.0) is None
    assert silence(15.0, 15.0, 60.0) == node_states.NodeEvent.SILENT
    assert silence(60.0, 15.0, 60.0) == node_states.NodeEvent.GONE
    assert silence(60.0, 15.0, 60.0, in_restart_grace=True) == node_states.NodeEvent.SILENT
    assert silence(5.0, 15.0, 60.0, in_restart_grace=True) is None


def test_node_silent_since_is_kept_beside_the_state() -> None:
    """None while ready; the last time heard on going silent; kept through suspect -> lost."""
    since = node_states.silent_since
    assert since(NodeState.READY, 40.0, 50.0) is None
    assert since(NodeState.SUSPECT, None, 50.0) == 50.0
    assert since(NodeState.LOST, 50.0, 50.0) == 50.0
    assert since(NodeState.LOST, 20.0, 50.0) == 20.0  # a remembered node: silent since the restart


def test_invalid_transitions_are_internal_errors() -> None:
    """A pair the table lacks is a bug of ours, never an operator's mistake."""
    assert issubclass(node_states.InvalidNodeTransition, InternalError)
    assert issubclass(InvalidReplicaTransition, InternalError)


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


def test_wants_engines_reads_the_tables_group() -> None:
    """A replica's engines are wanted when it is placed and its state is in WANTS_ENGINES:
    the table's group, not a second list kept by the model."""
    spec = Deployment(name="d", model="org/m", engine=EngineKind.VLLM, gpus_per_node=1, replicas=1)
    for state in S:
        r = Replica(id="d-0", deployment="d", index=0, spec=spec, state=state,
                    members=(Member(node_id="a", rank=0, gpus=(), port=1),))
        assert replica_states.wants_engines(r) == (state in WANTS_ENGINES), state
        assert not replica_states.wants_engines(Replica(id="d-0", deployment="d", index=0, spec=spec,
                                                        state=state)), state
    assert not hasattr(Replica, "wants_engines")


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

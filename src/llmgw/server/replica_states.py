"""The replica lifecycle as one table (in the manner of h11's _state.py and the agent's
engine_states.py).

`next_state(state, event)` is the only place a replica's state changes; reconcile and the
per-deployment steps turn what they observe (placements, engine reports, node states,
timers) into events. Counting restarts and backoff times stays with them: CRASH_LOOP means
"failed again, past the crash-loop threshold", not one failure. Any pair not in the table
is a bug and raises InvalidReplicaTransition.
"""

from __future__ import annotations

import enum

from llmgw.errors import LlmgwError
from llmgw.model.deployment import ReplicaState


class ReplicaEvent(enum.StrEnum):
    PLACED = "placed"  # placement found nodes: engines are asked for
    NO_ROOM = "no_room"  # placement found none: wait, with the reason
    UNPLACED = "unplaced"  # taken off its nodes, to be placed again (lost, drain, respec)
    ENGINES_READY = "engines_ready"  # every member's engine reports ready
    ENGINE_UNHEALTHY = "engine_unhealthy"  # a member's engine answers badly
    ENGINES_STARTING = "engines_starting"  # every member reported, not all ready yet
    NODE_BACK = "node_back"  # a held replica's lost node is back, its engines not all heard
    FAILED = "failed"  # a member's engine exited or failed: back off, then restart
    CRASH_LOOP = "crash_loop"  # failed again, past the crash-loop threshold
    RESTART = "restart"  # backoff over: start again in place, with a new generation
    NODE_LOST_HELD = "node_lost_held"  # a member's node is lost, the mass-loss guard holds
    # A stop that is no failure (scale-down, delete, replaced, rollout): a serving replica
    # drains first (DRAINS_FIRST); again while draining only gives a new reason.
    RETIRE = "retire"


class InvalidReplicaTransition(LlmgwError):
    """An event that cannot happen in the replica's current state: a bug of ours."""

    def __init__(self, state: ReplicaState, event: ReplicaEvent) -> None:
        self.state = state
        self.event = event
        super().__init__(f"replica event {event.value!r} is not valid in state {state.value!r}")


S = ReplicaState
E = ReplicaEvent

_PLACED_STATES = (S.STARTING, S.READY, S.UNHEALTHY, S.HELD)  # on nodes, engines wanted
_ANY = tuple(S)

TRANSITIONS: dict[tuple[ReplicaState, ReplicaEvent], ReplicaState] = {
    (S.PENDING, E.PLACED): S.STARTING,
    (S.PENDING, E.NO_ROOM): S.PENDING,
    **{(s, E.UNPLACED): S.PENDING for s in _ANY},
    **{(s, E.ENGINES_READY): S.READY for s in _PLACED_STATES},
    **{(s, E.ENGINE_UNHEALTHY): S.UNHEALTHY for s in _PLACED_STATES},
    **{(s, E.ENGINES_STARTING): S.STARTING for s in _PLACED_STATES},
    (S.HELD, E.NODE_BACK): S.STARTING,
    **{(s, E.FAILED): S.BACKOFF for s in _PLACED_STATES},
    **{(s, E.CRASH_LOOP): S.CRASH_LOOPING for s in _PLACED_STATES},
    (S.BACKOFF, E.RESTART): S.STARTING,
    (S.CRASH_LOOPING, E.RESTART): S.STARTING,
    **{(s, E.NODE_LOST_HELD): S.HELD for s in _PLACED_STATES},
    # Draining ends in removal (its engines' requests done, or drain_until passed, or a
    # failure: a crash, an unhealthy engine, a lost node): no state follows; UNPLACED
    # (every state's) is the only other way out. Engine reports move it nowhere else.
    (S.READY, E.RETIRE): S.DRAINING,
    (S.DRAINING, E.RETIRE): S.DRAINING,
}

# States whose replica has engines on its nodes (what the desired sets hold).
WANTS_ENGINES = frozenset({*_PLACED_STATES, S.DRAINING})
# States that a scale-down or a drain may stop before anything that serves.
NOT_SERVING = frozenset({S.PENDING, S.STARTING, S.UNHEALTHY, S.BACKOFF, S.CRASH_LOOPING, S.HELD})
# States a stop that is no failure drains first (RETIRE is valid in them); any other
# state serves nothing a router would send it, so such a stop is immediate.
DRAINS_FIRST = frozenset(s for (s, e) in TRANSITIONS if e == E.RETIRE)


def drains_first(state: ReplicaState) -> bool:
    return state in DRAINS_FIRST


def next_state(state: ReplicaState, event: ReplicaEvent) -> ReplicaState:
    try:
        return TRANSITIONS[state, event]
    except KeyError:
        raise InvalidReplicaTransition(state, event) from None

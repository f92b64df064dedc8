"""The replica lifecycle as one table (in the manner of h11's _state.py and the agent's
engine_states.py).

`next_state(state, event)` is the only place a replica's state changes; reconcile and the
per-deployment steps turn what they observe (placements, engine reports, node states,
timers) into events, the members' engine states through `engines_event`. Counting
restarts and backoff times stays with them: CRASH_LOOP means "failed again, past the
crash-loop threshold", not one failure. `state` None is a replica not yet known: births
are the table's pairs from None (a replica the rollout makes is born PENDING, the
model's default). Any pair not in the table is a bug and raises InvalidReplicaTransition.
The same API as the engine and node tables: TRANSITIONS, next_state, one typed error.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from llmgw.errors import InternalError
from llmgw.model.deployment import Replica, ReplicaState
from llmgw.model.engine import PREFLIGHT_RUNNING as PROBE_RUNNING
from llmgw.model.engine import EngineState


class ReplicaEvent(enum.StrEnum):
    PLACED = "placed"  # placement found nodes: engines are asked for
    NO_ROOM = "no_room"  # placement found none: wait, with the reason
    UNPLACED = "unplaced"  # taken off its nodes, to be placed again (lost, drain, respec)
    ENGINES_READY = "engines_ready"  # every member's engine reports ready
    ENGINE_UNHEALTHY = "engine_unhealthy"  # a member's engine answers badly
    ENGINES_STARTING = "engines_starting"  # every member reported, not all ready yet
    # A member reports its pre-flight probe running (collective pre-flight): the engines wait on it.
    # Passed everywhere: the members' engine states decide, as for any placed replica; a
    # failed one ends the member's launcher (exit 3), which is FAILED.
    PREFLIGHT_RUNNING = "preflight_running"
    NODE_BACK = "node_back"  # a held replica's lost node is back, its engines not all heard
    FAILED = "failed"  # a member's engine exited or failed: back off, then restart
    CRASH_LOOP = "crash_loop"  # failed again, past the crash-loop threshold
    RESTART = "restart"  # backoff over: start again in place, with a new generation
    NODE_LOST_HELD = "node_lost_held"  # a member's node is lost, the mass-loss guard holds
    # A stop that is no failure (scale-down, delete, replaced, rollout): a serving replica
    # drains first (DRAINS_FIRST); again while draining only gives a new reason.
    RETIRE = "retire"
    # Birth of a replica rebuilt from the engines it runs (a server that lost its store):
    # placed already, its engines' reports decide the rest.
    ADOPTED = "adopted"


class InvalidReplicaTransition(InternalError):
    """An event that cannot happen in the replica's current state: a bug of ours."""

    def __init__(self, state: ReplicaState | None, event: ReplicaEvent) -> None:
        self.state = state
        self.event = event
        where = state.value if state is not None else "not yet known"
        super().__init__(f"replica event {event.value!r} is not valid in state {where!r}")


S = ReplicaState
E = ReplicaEvent

_PLACED_STATES = (S.PREFLIGHT, S.STARTING, S.READY, S.UNHEALTHY, S.HELD)  # on nodes, engines wanted
# Where a probe can still be running: on the way up (a held one whose node came back
# mid-probe). Not READY or UNHEALTHY: every member's engine ran, so its probe was over.
_PROBING_STATES = (S.PREFLIGHT, S.STARTING, S.HELD)
_ANY = tuple(S)

TRANSITIONS: dict[tuple[ReplicaState | None, ReplicaEvent], ReplicaState] = {
    (None, E.ADOPTED): S.STARTING,
    (S.PENDING, E.PLACED): S.STARTING,
    (S.PENDING, E.NO_ROOM): S.PENDING,
    **{(s, E.UNPLACED): S.PENDING for s in _ANY},
    **{(s, E.ENGINES_READY): S.READY for s in _PLACED_STATES},
    **{(s, E.ENGINE_UNHEALTHY): S.UNHEALTHY for s in _PLACED_STATES},
    **{(s, E.ENGINES_STARTING): S.STARTING for s in _PLACED_STATES},
    (S.HELD, E.NODE_BACK): S.STARTING,
    **{(s, E.PREFLIGHT_RUNNING): S.PREFLIGHT for s in _PROBING_STATES},
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
NOT_SERVING = frozenset({S.PENDING, S.PREFLIGHT, S.STARTING, S.UNHEALTHY, S.BACKOFF,
                         S.CRASH_LOOPING, S.HELD})
# States a stop that is no failure drains first (RETIRE is valid in them); any other
# state serves nothing a router would send it, so such a stop is immediate.
DRAINS_FIRST = frozenset(s for (s, e) in TRANSITIONS if s is not None and e == E.RETIRE)
# Backing off: placed or not, no engines wanted until backoff_until, when RESTART is due.
BACKING_OFF = frozenset({S.BACKOFF, S.CRASH_LOOPING})
# In the routers' endpoint tables: READY is served; UNHEALTHY and HELD stay listed, the
# router judging by whether the engine answers (a held replica's node may come back).
ROUTABLE = frozenset({S.READY, S.UNHEALTHY, S.HELD})
# An engine reported in one of these is done for good (exited, or failed and being
# stopped; none is stopped on request while its replica wants it): its replica has
# FAILED, a drain ends on it, rebuild never adopts it.
ENGINE_ENDED = frozenset({EngineState.EXITED, EngineState.FAILED})


def wants_engines(r: Replica) -> bool:
    """True when the replica's engines belong in the desired sets: placed, in a state of
    the table's WANTS_ENGINES group."""
    return r.placed and r.state in WANTS_ENGINES


def drains_first(state: ReplicaState) -> bool:
    return state in DRAINS_FIRST


def next_state(state: ReplicaState | None, event: ReplicaEvent) -> ReplicaState:
    try:
        return TRANSITIONS[state, event]
    except KeyError:
        raise InvalidReplicaTransition(state, event) from None


def engines_event(state: ReplicaState, members: Sequence[EngineState | None],
                  preflight: Sequence[str] = ()) -> ReplicaEvent | None:
    """What a placed replica's member engines amount to, one entry per member in rank
    order: its engine's reported state (STARTING where it has not reported yet), None
    where the member's node is suspect (no news is not bad news); `preflight`, where
    given, each heard member's EngineReport.preflight. None: no event.

    FAILED (how the failure is counted, CRASH_LOOP or FAILED, is the caller's), else
    PREFLIGHT_RUNNING while a heard member's probe runs (in a state where one can: an
    engine that serves ran its probe long ago), else ENGINES_READY when every member is
    heard and ready, ENGINE_UNHEALTHY when one heard is unhealthy, ENGINES_STARTING when
    every member is heard, NODE_BACK for a held replica with a member still unheard."""
    known = [st for st in members if st is not None]
    if any(st in ENGINE_ENDED for st in known):
        return E.FAILED
    if state in _PROBING_STATES and any(
            pf == PROBE_RUNNING for st, pf in zip(members, preflight, strict=False)
            if st is not None):
        return E.PREFLIGHT_RUNNING
    if known and len(known) == len(members) and all(st == EngineState.READY for st in known):
        return E.ENGINES_READY
    if any(st == EngineState.UNHEALTHY for st in known):
        return E.ENGINE_UNHEALTHY
    if len(known) == len(members):
        return E.ENGINES_STARTING
    if state == S.HELD:
        return E.NODE_BACK
    return None

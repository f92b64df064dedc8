"""The engine lifecycle as one table (in the manner of h11's _state.py).

`transition(state, event)` is the only place an engine's state changes. `state` is None
for an engine the supervisor knows of but has not started or adopted yet. Counting health
failures, timers and signals stay with the supervisor: it turns them into events
(HEALTH_FAIL means "failed `threshold` times in a row", not one failed probe).

Pairs that arrive late through a race (a health result after a stop was asked, a
startup timer that fires just after the first 200) are listed as no-ops; any pair not in
the table is a bug and raises InvalidTransition.
"""

from __future__ import annotations

import enum

from llmgw.errors import EngineError
from llmgw.model.engine import EngineState


class EngineEvent(enum.StrEnum):
    STARTED = "started"  # the process was spawned and its record written
    ADOPTED = "adopted"  # a recorded process, alive with its start time, taken over
    HEALTH_OK = "health_ok"  # GET /health answered 200
    HEALTH_FAIL = "health_fail"  # health failed the threshold number of times in a row
    STARTUP_TIMEOUT = "startup_timeout"  # not ready within the spec's startup timeout
    # Its port answers, but from a process outside its session (another cluster's engine):
    # never ready; the supervisor stops it and reports the conflict.
    PORT_CONFLICT = "port_conflict"
    STOP_REQUESTED = "stop_requested"  # the desired set no longer wants it
    EXITED = "exited"  # the process is gone (exit code or signal)


class InvalidTransition(EngineError):
    """An event that cannot happen in the engine's current state."""

    def __init__(self, state: EngineState | None, event: EngineEvent) -> None:
        self.state = state
        self.event = event
        where = state.value if state is not None else "not started"
        super().__init__(f"engine event {event.value!r} is not valid in state {where!r}")


S = EngineState
E = EngineEvent
_SAME = ""  # reason for a no-op: the state does not change

# (state, event) -> (new state, reason)
TRANSITIONS: dict[tuple[EngineState | None, EngineEvent], tuple[EngineState, str]] = {
    (None, E.STARTED): (S.STARTING, "process started"),
    (None, E.ADOPTED): (S.STARTING, "adopted a running engine after an agent restart"),
    (None, E.EXITED): (S.EXITED, "process gone before it could be adopted"),
    (S.STARTING, E.HEALTH_OK): (S.READY, "first health check passed"),
    (S.STARTING, E.HEALTH_FAIL): (S.STARTING, _SAME),  # still loading: refused is normal
    (S.STARTING, E.STARTUP_TIMEOUT): (S.FAILED, "not ready within its startup timeout"),
    (S.STARTING, E.PORT_CONFLICT): (S.FAILED, "its port is answered by another process"),
    (S.STARTING, E.STOP_REQUESTED): (S.STOPPING, "stop requested while starting"),
    (S.STARTING, E.EXITED): (S.EXITED, "exited while starting"),
    (S.READY, E.HEALTH_OK): (S.READY, _SAME),
    (S.READY, E.HEALTH_FAIL): (S.UNHEALTHY, "health checks failing"),
    (S.READY, E.STARTUP_TIMEOUT): (S.READY, _SAME),  # timer raced the first 200
    (S.READY, E.PORT_CONFLICT): (S.FAILED, "its port is answered by another process"),
    (S.READY, E.STOP_REQUESTED): (S.STOPPING, "stop requested"),
    (S.READY, E.EXITED): (S.EXITED, "exited unexpectedly"),
    (S.UNHEALTHY, E.HEALTH_OK): (S.READY, "health recovered"),
    (S.UNHEALTHY, E.HEALTH_FAIL): (S.UNHEALTHY, _SAME),
    (S.UNHEALTHY, E.STARTUP_TIMEOUT): (S.UNHEALTHY, _SAME),
    (S.UNHEALTHY, E.PORT_CONFLICT): (S.FAILED, "its port is answered by another process"),
    (S.UNHEALTHY, E.STOP_REQUESTED): (S.STOPPING, "stop requested"),
    (S.UNHEALTHY, E.EXITED): (S.EXITED, "exited unexpectedly"),
    (S.FAILED, E.HEALTH_OK): (S.FAILED, _SAME),  # too late: the server decides
    (S.FAILED, E.HEALTH_FAIL): (S.FAILED, _SAME),
    (S.FAILED, E.STARTUP_TIMEOUT): (S.FAILED, _SAME),
    (S.FAILED, E.PORT_CONFLICT): (S.FAILED, _SAME),
    (S.FAILED, E.STOP_REQUESTED): (S.STOPPING, "stop requested"),
    (S.FAILED, E.EXITED): (S.EXITED, "exited after failing to start"),
    (S.STOPPING, E.HEALTH_OK): (S.STOPPING, _SAME),
    (S.STOPPING, E.HEALTH_FAIL): (S.STOPPING, _SAME),
    (S.STOPPING, E.STARTUP_TIMEOUT): (S.STOPPING, _SAME),
    (S.STOPPING, E.PORT_CONFLICT): (S.STOPPING, _SAME),
    (S.STOPPING, E.STOP_REQUESTED): (S.STOPPING, _SAME),
    (S.STOPPING, E.EXITED): (S.EXITED, "stopped on request"),
    (S.EXITED, E.STARTED): (S.STARTING, "process started again"),
    (S.EXITED, E.STOP_REQUESTED): (S.EXITED, _SAME),  # nothing left to stop
}


def transition(state: EngineState | None, event: EngineEvent) -> tuple[EngineState, str]:
    """The state after `event`, and the reason to report ("" when nothing changed)."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(state, event) from None


def is_live(state: EngineState | None) -> bool:
    """Whether a process may still be running in this state."""
    return state in (S.STARTING, S.READY, S.UNHEALTHY, S.FAILED, S.STOPPING)

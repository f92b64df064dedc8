"""The engine lifecycle as one table (in the manner of h11's _state.py).

`next_state(phase, event)` is the only place an engine's phase changes. `phase` is None
for an engine the supervisor knows of but has not started or adopted yet. Counting health
failures, timers and signals stay with the supervisor: it turns them into events
(HEALTH_FAIL means "failed `threshold` times in a row", not one failed probe). The table
holds no reasons: the caller says why (the pid, the exit code, the timeout it gave).

The table's states are the reported EngineState's, with one more: FAILED_STOPPING, an
engine being stopped because it failed (its startup timeout, a port conflict). It is
reported as stopping, as any stop is; that it failed decides its exit (what it is reported
as and that the server hears of it), so the phase keeps it rather than a flag beside it.

Pairs that arrive late through a race (a health result after a stop was asked, a
startup timer that fires just after the first 200) are listed as no-ops; any pair not in
the table is a bug and raises InvalidTransition, an internal error (logged with its
traceback by the shell, never shown as an operator's mistake). The same API as the
replica and node tables: TRANSITIONS, next_state, one typed error.

`EngineLifecycle` holds one engine's phase and what is kept beside it: the stop asked
and why, the failure and why. Its rules live here, not in the supervisor: a failure
asks the engine's stop (FAILURE_STOPS), the exit's reason is composed in one order, and
whether the server hears of the exit follows from the failure and the stop.
"""

from __future__ import annotations

import enum

from attrs import define

from llmgw.errors import InternalError
from llmgw.model.engine import EngineState


class Phase(enum.StrEnum):
    """The table's states: EngineState's (the same values), and FAILED_STOPPING."""

    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    FAILED = "failed"  # never ready: its startup timeout passed, or its port is another's
    STOPPING = "stopping"
    FAILED_STOPPING = "failed-stopping"  # stopped because it failed; reported as stopping
    EXITED = "exited"


class EngineEvent(enum.StrEnum):
    STARTED = "started"  # the process was spawned and its record written
    ADOPTED = "adopted"  # a recorded process, alive with its start time, taken over
    HEALTH_OK = "health_ok"  # GET /health answered 200
    HEALTH_FAIL = "health_fail"  # health failed the threshold number of times in a row
    # The leader process exited and processes of its session remain (vLLM's EngineCore,
    # workers, Ray): no longer serving from this moment, while what is left is stopped.
    LEADER_EXITED = "leader_exited"
    STARTUP_TIMEOUT = "startup_timeout"  # not ready within the spec's startup timeout
    # Its port answers, but from a process outside its session (another cluster's engine):
    # never ready; the supervisor stops it and reports the conflict.
    PORT_CONFLICT = "port_conflict"
    STOP_REQUESTED = "stop_requested"  # the desired set no longer wants it, or it failed
    EXITED = "exited"  # the process is gone (exit code or signal)


class InvalidTransition(InternalError):
    """An event that cannot happen in the engine's current phase: a bug of ours."""

    def __init__(self, phase: Phase | None, event: EngineEvent) -> None:
        self.phase = phase
        self.event = event
        where = phase.value if phase is not None else "not started"
        super().__init__(f"engine event {event.value!r} is not valid in state {where!r}")


P = Phase
E = EngineEvent

TRANSITIONS: dict[tuple[Phase | None, EngineEvent], Phase] = {
    (None, E.STARTED): P.STARTING,
    (None, E.ADOPTED): P.STARTING,  # after an agent restart
    (None, E.EXITED): P.EXITED,  # gone before it could be adopted, or never started
    (P.STARTING, E.HEALTH_OK): P.READY,
    (P.STARTING, E.HEALTH_FAIL): P.STARTING,  # still loading: refused is normal
    (P.STARTING, E.LEADER_EXITED): P.STARTING,  # was not serving: nothing to take back
    (P.STARTING, E.STARTUP_TIMEOUT): P.FAILED,
    (P.STARTING, E.PORT_CONFLICT): P.FAILED,
    (P.STARTING, E.STOP_REQUESTED): P.STOPPING,
    (P.STARTING, E.EXITED): P.EXITED,
    (P.READY, E.HEALTH_OK): P.READY,
    (P.READY, E.HEALTH_FAIL): P.UNHEALTHY,
    (P.READY, E.LEADER_EXITED): P.UNHEALTHY,
    (P.READY, E.STARTUP_TIMEOUT): P.READY,  # timer raced the first 200
    (P.READY, E.PORT_CONFLICT): P.FAILED,
    (P.READY, E.STOP_REQUESTED): P.STOPPING,
    (P.READY, E.EXITED): P.EXITED,
    (P.UNHEALTHY, E.HEALTH_OK): P.READY,
    (P.UNHEALTHY, E.HEALTH_FAIL): P.UNHEALTHY,
    (P.UNHEALTHY, E.LEADER_EXITED): P.UNHEALTHY,
    (P.UNHEALTHY, E.STARTUP_TIMEOUT): P.UNHEALTHY,
    (P.UNHEALTHY, E.PORT_CONFLICT): P.FAILED,
    (P.UNHEALTHY, E.STOP_REQUESTED): P.STOPPING,
    (P.UNHEALTHY, E.EXITED): P.EXITED,
    (P.FAILED, E.HEALTH_OK): P.FAILED,  # too late: the server decides
    (P.FAILED, E.HEALTH_FAIL): P.FAILED,
    (P.FAILED, E.STARTUP_TIMEOUT): P.FAILED,
    (P.FAILED, E.PORT_CONFLICT): P.FAILED,
    # Its leader exited before the stop its failure asked took hold: it was never
    # serving (or no longer is), nothing to take back.
    (P.FAILED, E.LEADER_EXITED): P.FAILED,
    (P.FAILED, E.STOP_REQUESTED): P.FAILED_STOPPING,
    (P.FAILED, E.EXITED): P.EXITED,
    **{(p, e): p for p in (P.STOPPING, P.FAILED_STOPPING)
       for e in (E.HEALTH_OK, E.HEALTH_FAIL, E.STARTUP_TIMEOUT, E.PORT_CONFLICT, E.STOP_REQUESTED)},
    (P.STOPPING, E.EXITED): P.EXITED,
    (P.FAILED_STOPPING, E.EXITED): P.EXITED,
    (P.EXITED, E.STARTED): P.STARTING,
    (P.EXITED, E.STOP_REQUESTED): P.EXITED,  # nothing left to stop
}

# Phases of an engine that failed: its exit is reported as the failure's, and kept for
# the server even though a stop was asked (the stop was the supervisor's, not the server's).
FAILING = frozenset({P.FAILED, P.FAILED_STOPPING})
# Phases in which a process may still be running.
LIVE = frozenset({P.STARTING, P.READY, P.UNHEALTHY, P.FAILED, P.STOPPING, P.FAILED_STOPPING})


def next_state(phase: Phase | None, event: EngineEvent) -> Phase:
    """The phase after `event`; the same phase for a no-op pair (nothing to report)."""
    try:
        return TRANSITIONS[phase, event]
    except KeyError:
        raise InvalidTransition(phase, event) from None


def reported(phase: Phase) -> EngineState:
    """What an engine's report says of `phase`: a failed engine's stop is a stop."""
    return EngineState.STOPPING if phase is P.FAILED_STOPPING else EngineState(phase.value)


def is_live(phase: Phase | None) -> bool:
    """Whether a process may still be running in this phase."""
    return phase in LIVE


# The events by which an engine fails (the table's way into FAILED), and what the stop
# that its failure asks at once says: FAILED => stop, one rule.
FAILURE_STOPS: dict[EngineEvent, str] = {
    E.STARTUP_TIMEOUT: "failed to start in time",
    E.PORT_CONFLICT: "its port is answered by another process",
}


@define(frozen=True)
class Move:
    """What one event did to an engine: its phase before and after, and whether the shell
    must stop the engine now (it has just failed)."""

    was: Phase | None
    now: Phase
    stop: bool = False

    @property
    def changed(self) -> bool:
        return self.now is not self.was


@define
class EngineLifecycle:
    """One engine's phase and the flags beside it, moved only by `handle` and
    `request_stop`. Pure: the shell turns `Move.stop` into its signal to the stopper."""

    phase: Phase | None = None
    stop_asked: bool = False
    stop_reason: str = ""
    failed: bool = False
    # Why it failed: its exit's reason, which the stop that follows does not replace.
    failure: str = ""

    def handle(self, event: EngineEvent, why: str = "") -> Move:
        """Move through the table; an event that makes it FAILED keeps `why` as the
        failure (the first failure's: a later one is a no-op of the table) and asks its
        stop."""
        was = self.phase
        self.phase = next_state(was, event)
        if self.phase is not P.FAILED or was in FAILING:
            return Move(was, self.phase)
        self.failed = True
        self.failure = why
        self.request_stop(FAILURE_STOPS[event])
        return Move(was, self.phase, stop=True)

    def request_stop(self, reason: str) -> None:
        """A stop is asked (the desired set, or a failure); the latest reason is said."""
        self.stop_asked = True
        self.stop_reason = reason

    def died_starting(self) -> bool:
        """Whether it is ending before its first 200 with no stop asked: its exit may be
        explained by its port or its weights."""
        return self.phase is P.STARTING and not self.stop_asked

    def exit_reason(self, *, code: int | None, killed: bool, stop_timeout: float,
                    port_taken: str = "") -> str:
        """Why it exited, in this order: its failure, its port taken by another process
        while it started, the stop asked (with the SIGKILL if one was needed), its exit code."""
        if self.failed:
            return self.failure
        if port_taken:
            return port_taken
        if self.stop_asked:
            reason = f"stopped: {self.stop_reason}"
            return reason + (f" (SIGKILL after {stop_timeout:g}s)" if killed else "")
        if code is None:
            return "exited (exit code unknown: adopted process)"
        return f"exited with code {code}"

    def server_hears(self) -> bool:
        """Whether its exit is kept for the server (reports() and Hello): an exit of its
        own or a failure, not a stop the server asked for."""
        return not self.stop_asked or self.failed

import itertools

import pytest

from llmgw.agent.lifecycle.states import (
    FAILING,
    FAILURE_STOPS,
    TRANSITIONS,
    EngineEvent,
    EngineLifecycle,
    InvalidTransition,
    Phase,
    is_live,
    next_state,
    reported,
)
from llmgw.errors import InternalError, LlmgwError
from llmgw.model.engine import EngineState

P, E = Phase, EngineEvent


def run(*events: EngineEvent, start: Phase | None = None) -> list[Phase]:
    phase, out = start, []
    for ev in events:
        phase = next_state(phase, ev)
        out.append(phase)
    return out


def test_happy_path_and_stop() -> None:
    seq = run(E.STARTED, E.HEALTH_FAIL, E.HEALTH_OK, E.HEALTH_OK, E.STOP_REQUESTED, E.EXITED)
    assert seq == [
        P.STARTING, P.STARTING, P.READY, P.READY, P.STOPPING, P.EXITED,
    ]  # fmt: skip


def test_unhealthy_and_recovery() -> None:
    seq = run(E.STARTED, E.HEALTH_OK, E.HEALTH_FAIL, E.HEALTH_FAIL, E.HEALTH_OK)
    assert seq[2:] == [P.UNHEALTHY, P.UNHEALTHY, P.READY]


def test_startup_timeout_fails_then_exit() -> None:
    seq = run(E.STARTED, E.STARTUP_TIMEOUT, E.HEALTH_OK, E.EXITED)
    assert seq == [P.STARTING, P.FAILED, P.FAILED, P.EXITED]


def test_a_failed_engine_stopped_stays_failing_and_reports_stopping() -> None:
    seq = run(E.STARTED, E.PORT_CONFLICT, E.STOP_REQUESTED, E.HEALTH_OK, E.EXITED)
    assert seq == [P.STARTING, P.FAILED, P.FAILED_STOPPING, P.FAILED_STOPPING, P.EXITED]
    assert [reported(p) for p in seq] == [
        EngineState.STARTING, EngineState.FAILED, EngineState.STOPPING, EngineState.STOPPING,
        EngineState.EXITED]
    assert FAILING == {P.FAILED, P.FAILED_STOPPING}
    # A stop on request is no failure.
    assert not FAILING & set(run(E.STARTED, E.HEALTH_OK, E.STOP_REQUESTED))


def test_leader_exited_takes_a_ready_engine_out() -> None:
    assert run(E.STARTED, E.HEALTH_OK, E.LEADER_EXITED, E.EXITED)[2:] == [P.UNHEALTHY, P.EXITED]
    assert next_state(P.STARTING, E.LEADER_EXITED) is P.STARTING  # was not serving
    assert next_state(P.UNHEALTHY, E.LEADER_EXITED) is P.UNHEALTHY


def test_crash_and_never_started() -> None:
    assert next_state(P.STARTING, E.EXITED) is P.EXITED
    assert next_state(P.READY, E.EXITED) is P.EXITED
    assert next_state(None, E.EXITED) is P.EXITED


def test_adoption() -> None:
    assert run(E.ADOPTED, E.HEALTH_OK)[-1] is P.READY


def test_timer_racing_first_ok_is_a_noop() -> None:
    assert next_state(P.READY, E.STARTUP_TIMEOUT) is P.READY


@pytest.mark.parametrize(
    ("phase", "event"),
    [
        (None, E.HEALTH_OK),
        (None, E.STOP_REQUESTED),
        (P.STARTING, E.STARTED),
        (P.READY, E.ADOPTED),
        (P.EXITED, E.EXITED),
        (P.EXITED, E.HEALTH_OK),
        (P.STOPPING, E.LEADER_EXITED),  # fired only when no stop was asked
    ],
)
def test_invalid_transitions_raise(phase: Phase | None, event: EngineEvent) -> None:
    with pytest.raises(InvalidTransition) as info:
        next_state(phase, event)
    assert isinstance(info.value, LlmgwError)
    assert event.value in str(info.value)


def test_table_is_total_or_raises() -> None:
    """Every (phase, event) pair either is in the table or raises; results are phases."""
    for phase, event in itertools.product([None, *P], E):
        if (phase, event) in TRANSITIONS:
            assert isinstance(next_state(phase, event), Phase)
        else:
            with pytest.raises(InvalidTransition):
                next_state(phase, event)


def test_phases_report_as_engine_states() -> None:
    """Every phase but FAILED_STOPPING is reported as the EngineState of its name."""
    for phase in P:
        want = EngineState.STOPPING if phase is P.FAILED_STOPPING else EngineState[phase.name]
        assert reported(phase) is want
    assert {reported(p) for p in P} == set(EngineState)


def test_every_live_phase_can_be_stopped_and_can_exit() -> None:
    for phase in P:
        if is_live(phase):
            assert (phase, E.STOP_REQUESTED) in TRANSITIONS
            assert next_state(phase, E.EXITED) is P.EXITED
    assert not is_live(P.EXITED) and not is_live(None)


# ---- the lifecycle's rules (EngineLifecycle) ----

def test_every_row_of_the_table() -> None:
    """Each row, applied to a lifecycle in its phase, lands where the table says, and
    only a way into FAILED from outside the failing phases asks a stop."""
    for (phase, event), want in TRANSITIONS.items():
        life = EngineLifecycle(phase=phase)
        move = life.handle(event, "why")
        assert (move.was, move.now, life.phase) == (phase, want, want)
        assert move.changed is (want is not phase)
        fails = want is P.FAILED and phase not in FAILING
        assert move.stop is fails and life.stop_asked is fails and life.failed is fails
        if fails:
            assert event in FAILURE_STOPS and life.stop_reason == FAILURE_STOPS[event]


def test_the_failed_engines_leader_exiting_is_a_row() -> None:
    """Its leader gone before the stop its failure asked took hold: still failed."""
    assert TRANSITIONS[P.FAILED, E.LEADER_EXITED] is P.FAILED
    life = EngineLifecycle(phase=P.STARTING)
    life.handle(E.STARTUP_TIMEOUT, "not ready within 1s")
    assert life.handle(E.LEADER_EXITED).now is P.FAILED
    assert life.exit_reason(code=0, killed=False, stop_timeout=10.0) == "not ready within 1s"


def test_invalid_transition_is_an_internal_error() -> None:
    with pytest.raises(InternalError):
        EngineLifecycle(phase=P.EXITED).handle(E.HEALTH_OK)


def test_a_failure_asks_the_stop_once_and_keeps_the_first_reason() -> None:
    life = EngineLifecycle()
    life.handle(E.STARTED)
    move = life.handle(E.PORT_CONFLICT, "port 8000 is answered by pid 7 (nginx)")
    assert move.stop and life.stop_reason == "its port is answered by another process"
    again = life.handle(E.STARTUP_TIMEOUT, "not ready within 1s")
    assert not again.stop and not again.changed
    assert life.stop_asked and life.failure == "port 8000 is answered by pid 7 (nginx)"
    life.handle(E.STOP_REQUESTED)
    assert life.phase is P.FAILED_STOPPING
    assert life.exit_reason(code=-15, killed=True, stop_timeout=10.0) == life.failure
    assert life.server_hears()  # the stop was the agent's, not the server's


def test_exit_reason_order_and_who_hears() -> None:
    def ended(*events: EngineEvent, stop: str = "") -> EngineLifecycle:
        life = EngineLifecycle()
        for ev in events:
            life.handle(ev)
        if stop:
            life.request_stop(stop)
        return life

    own = ended(E.STARTED, E.HEALTH_OK)
    assert own.exit_reason(code=3, killed=False, stop_timeout=10.0) == "exited with code 3"
    assert own.exit_reason(code=None, killed=False, stop_timeout=10.0) == (
        "exited (exit code unknown: adopted process)")
    assert own.server_hears() and not own.died_starting()
    starting = ended(E.STARTED)
    assert starting.died_starting()
    assert starting.exit_reason(code=1, killed=False, stop_timeout=10.0,
                                port_taken="port 8000 is taken") == "port 8000 is taken"
    stopped = ended(E.STARTED, E.HEALTH_OK, stop="not in the desired set")
    assert stopped.exit_reason(code=0, killed=False, stop_timeout=10.0) == (
        "stopped: not in the desired set")
    assert stopped.exit_reason(code=-9, killed=True, stop_timeout=10.0) == (
        "stopped: not in the desired set (SIGKILL after 10s)")
    assert not stopped.server_hears()
    assert not ended(E.STARTED, stop="gone").died_starting()

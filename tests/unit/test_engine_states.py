import itertools

import pytest

from llmgw.agent.lifecycle.states import (
    FAILING,
    TRANSITIONS,
    EngineEvent,
    InvalidTransition,
    Phase,
    is_live,
    next_state,
    reported,
)
from llmgw.errors import LlmgwError
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

import itertools

import pytest

from llmgw.agent.engine_states import (
    TRANSITIONS,
    EngineEvent,
    InvalidTransition,
    is_live,
    transition,
)
from llmgw.errors import LlmgwError
from llmgw.model.engine import EngineState

S, E = EngineState, EngineEvent


def run(*events: EngineEvent, start: EngineState | None = None) -> list[tuple[EngineState, str]]:
    state, out = start, []
    for ev in events:
        state, reason = transition(state, ev)
        out.append((state, reason))
    return out


def test_happy_path_and_stop() -> None:
    seq = run(E.STARTED, E.HEALTH_FAIL, E.HEALTH_OK, E.HEALTH_OK, E.STOP_REQUESTED, E.EXITED)
    assert [s for s, _ in seq] == [
        S.STARTING, S.STARTING, S.READY, S.READY, S.STOPPING, S.EXITED,
    ]  # fmt: skip
    assert seq[0][1] == "process started"
    assert seq[1][1] == "" and seq[3][1] == ""  # no change, no reason
    assert seq[-1][1] == "stopped on request"


def test_unhealthy_and_recovery() -> None:
    seq = run(E.STARTED, E.HEALTH_OK, E.HEALTH_FAIL, E.HEALTH_FAIL, E.HEALTH_OK)
    assert [s for s, _ in seq][2:] == [S.UNHEALTHY, S.UNHEALTHY, S.READY]
    assert seq[-1][1] == "health recovered"


def test_startup_timeout_fails_then_exit() -> None:
    seq = run(E.STARTED, E.STARTUP_TIMEOUT, E.HEALTH_OK, E.EXITED)
    assert [s for s, _ in seq] == [S.STARTING, S.FAILED, S.FAILED, S.EXITED]
    assert "startup timeout" in seq[1][1]


def test_crash_reasons() -> None:
    assert transition(S.STARTING, E.EXITED) == (S.EXITED, "exited while starting")
    assert transition(S.READY, E.EXITED) == (S.EXITED, "exited unexpectedly")
    assert transition(None, E.EXITED)[0] is S.EXITED


def test_adoption() -> None:
    assert run(E.ADOPTED, E.HEALTH_OK)[-1][0] is S.READY


def test_timer_racing_first_ok_is_a_noop() -> None:
    assert transition(S.READY, E.STARTUP_TIMEOUT) == (S.READY, "")


@pytest.mark.parametrize(
    ("state", "event"),
    [
        (None, E.HEALTH_OK),
        (None, E.STOP_REQUESTED),
        (S.STARTING, E.STARTED),
        (S.READY, E.ADOPTED),
        (S.EXITED, E.EXITED),
        (S.EXITED, E.HEALTH_OK),
    ],
)
def test_invalid_transitions_raise(state: EngineState | None, event: EngineEvent) -> None:
    with pytest.raises(InvalidTransition) as info:
        transition(state, event)
    assert isinstance(info.value, LlmgwError)
    assert event.value in str(info.value)


def test_table_is_total_or_raises() -> None:
    """Every (state, event) pair either is in the table or raises; results are states."""
    for state, event in itertools.product([None, *S], E):
        if (state, event) in TRANSITIONS:
            new, reason = transition(state, event)
            assert isinstance(new, EngineState)
            assert (reason == "") == (new == state), (state, event)
        else:
            with pytest.raises(InvalidTransition):
                transition(state, event)


def test_every_live_state_can_be_stopped_and_can_exit() -> None:
    for state in S:
        if is_live(state):
            assert (state, E.STOP_REQUESTED) in TRANSITIONS
            assert transition(state, E.EXITED)[0] is S.EXITED
    assert not is_live(S.EXITED) and not is_live(None)

"""The pure health table: NVML readings in, hard and soft problem lines out; the read
error streak and the reset watch (issue 30 item 3)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.discovery.gpu_health import (
    FABRIC_COMPLETED,
    FABRIC_IN_PROGRESS,
    FABRIC_NOT_STARTED,
    FABRIC_NOT_SUPPORTED,
    READ_ERRORS_IN_A_ROW,
    FabricReading,
    HealthReading,
    ReadStreak,
    ResetWatch,
    classify,
    health_problems,
    next_reset_watch,
    next_streak,
)
from llmgw.model.inventory import SOFT_MARK, Gpu, hard_problems, is_soft, soft_problems


def test_nothing_supported_is_healthy() -> None:
    assert health_problems(HealthReading()) == ()


def test_all_clear_is_healthy() -> None:
    r = HealthReading(mig_current=0, ecc_uncorrected_volatile=0, remapped_rows=(12, 0, 0, 0),
                      retired_pages_pending=0, fabric=FabricReading(FABRIC_COMPLETED, 0))
    assert health_problems(r) == ()


HARD = [
    (HealthReading(mig_current=1), "MIG mode is on (llmgw places whole GPUs)"),
    (HealthReading(remapped_rows=(0, 1, 0, 1)), "row remap failed"),
    (HealthReading(fabric=FabricReading(FABRIC_IN_PROGRESS, 0)), "NVSwitch fabric not ready (in progress)"),
    (HealthReading(fabric=FabricReading(FABRIC_COMPLETED, 999, "Unknown Error")),
     "NVSwitch fabric registration failed: Unknown Error"),
    (HealthReading(fabric=FabricReading(FABRIC_COMPLETED, 10)), "NVSwitch fabric registration failed: NVML status 10"),
    (HealthReading(fabric=FabricReading(7, 0)), "NVSwitch fabric in an unknown state (7)"),
    (HealthReading(recovery_action=1), "NVML asks to reset the GPU (recovery action 1)"),
    (HealthReading(recovery_action=2), "NVML asks to reboot the node (recovery action 2)"),
    (HealthReading(recovery_action=3), "NVML asks to drain peer-to-peer traffic (recovery action 3)"),
    (HealthReading(recovery_action=4),
     "NVML asks to drain peer-to-peer traffic and reset the GPU (recovery action 4)"),
    (HealthReading(recovery_action=99), "NVML asks to recovery action 99 (recovery action 99)"),
]
SOFT = [
    (HealthReading(ecc_uncorrected_volatile=1), "1 volatile uncorrected ECC error"),
    (HealthReading(ecc_uncorrected_volatile=3), "3 volatile uncorrected ECC errors"),
    (HealthReading(remapped_rows=(0, 1, 1, 0)), "row remap pending (reset the GPU when it is idle)"),
    (HealthReading(retired_pages_pending=1), "retired pages pending (reset the GPU when it is idle)"),
]


@pytest.mark.parametrize(("reading", "problem"), HARD)
def test_each_hard_problem(reading: HealthReading, problem: str) -> None:
    assert classify(reading).hard == (problem,) and classify(reading).soft == ()
    assert health_problems(reading) == (problem,)


@pytest.mark.parametrize(("reading", "problem"), SOFT)
def test_each_soft_problem_is_marked_and_never_hard(reading: HealthReading, problem: str) -> None:
    """A pending remap, pending retired pages and volatile ECC errors keep new work off,
    never move what runs: before issue 30 each was a problem that drained the GPU."""
    health = classify(reading)
    assert health.hard == () and health.soft == (SOFT_MARK + problem,)
    gpu = Gpu(0, "GPU-0", "", 0, 0, "", problems=health.lines)
    assert gpu.healthy and not gpu.placeable
    assert gpu.hard_problems == () and gpu.soft_problems == (problem,)


def test_recovery_action_none_is_no_problem() -> None:
    assert classify(HealthReading(recovery_action=0)) == classify(HealthReading())


def test_fabric_not_supported_is_no_problem() -> None:
    assert health_problems(HealthReading(fabric=FabricReading(FABRIC_NOT_SUPPORTED, 0))) == ()


def test_fabric_not_started_points_at_the_fabric_manager() -> None:
    (p,) = health_problems(HealthReading(fabric=FabricReading(FABRIC_NOT_STARTED, 0)))
    assert p.startswith("NVSwitch fabric not ready") and "nvidia-fabricmanager" in p


def test_several_problems_hard_first() -> None:
    r = HealthReading(mig_current=1, ecc_uncorrected_volatile=2, remapped_rows=(0, 2, 1, 1))
    assert health_problems(r) == ("MIG mode is on (llmgw places whole GPUs)", "row remap failed",
                                  SOFT_MARK + "2 volatile uncorrected ECC errors",
                                  SOFT_MARK + "row remap pending (reset the GPU when it is idle)")


readings = st.builds(
    HealthReading,
    mig_current=st.none() | st.integers(0, 1),
    ecc_uncorrected_volatile=st.none() | st.integers(0, 10),
    remapped_rows=st.none() | st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 1), st.integers(0, 1)),
    retired_pages_pending=st.none() | st.integers(0, 1),
    fabric=st.none() | st.builds(FabricReading, st.integers(0, 4), st.integers(0, 20)),
    recovery_action=st.none() | st.integers(0, 8),
)


@given(readings)
def test_classify_splits_every_line_once(r: HealthReading) -> None:
    """Every line is hard or soft, never both; the model reads the split back; a reading
    with nothing hard leaves the GPU healthy (what runs on it stays)."""
    health = classify(r)
    assert all(not is_soft(p) for p in health.hard) and all(is_soft(p) for p in health.soft)
    assert hard_problems(health.lines) == health.hard
    assert soft_problems(health.lines) == tuple(p.removeprefix(SOFT_MARK) for p in health.soft)
    hard_cause = (r.mig_current == 1 or (r.remapped_rows is not None and r.remapped_rows[3] == 1)
                  or r.recovery_action not in (None, 0)
                  or (r.fabric is not None and not (r.fabric.state == FABRIC_NOT_SUPPORTED
                      or (r.fabric.state == FABRIC_COMPLETED and r.fabric.status == 0))))
    assert bool(health.hard) == hard_cause


# ---- the read error streak ----


def test_one_read_error_is_no_problem_until_the_streak() -> None:
    state = ReadStreak()
    for n in range(1, READ_ERRORS_IN_A_ROW):
        state, problems = next_streak(state, {"ECC errors": "Unknown Error"})
        assert problems == () and state.counts == {"ECC errors": n}
    state, problems = next_streak(state, {"ECC errors": "Unknown Error"})
    assert problems == (f"NVML error reading ECC errors ({READ_ERRORS_IN_A_ROW} reads in a row): Unknown Error",)


def test_a_good_read_starts_the_streak_again() -> None:
    state, _ = next_streak(ReadStreak(), {"memory": "Timeout"})
    state, _ = next_streak(state, {"memory": "Timeout"})
    state, problems = next_streak(state, {})
    assert state.counts == {} and problems == ()
    state, problems = next_streak(state, {"memory": "Timeout"})
    assert problems == ()


@given(st.lists(st.sets(st.sampled_from(["UUID", "memory", "ECC errors", "remapped rows"])), max_size=12))
def test_streak_counts_each_field_in_a_row(reads: list[set[str]]) -> None:
    """A field is a problem exactly when its last READ_ERRORS_IN_A_ROW reads all failed."""
    state = ReadStreak()
    for k, failed in enumerate(reads):
        state, problems = next_streak(state, {f: "Unknown Error" for f in failed})
        for f in ["UUID", "memory", "ECC errors", "remapped rows"]:
            run = 0
            for past in reversed(reads[: k + 1]):
                if f not in past:
                    break
                run += 1
            assert state.counts.get(f, 0) == run
            assert any(p.startswith(f"NVML error reading {f} ") for p in problems) == (run >= READ_ERRORS_IN_A_ROW)


# ---- the reset watch ----


def test_pending_remap_that_clears_is_a_reset() -> None:
    w, reset = next_reset_watch(ResetWatch(), HealthReading(remapped_rows=(0, 1, 1, 0), recovery_action=0))
    assert not reset and w.seen == {"remap pending"}
    w, reset = next_reset_watch(w, HealthReading(remapped_rows=(0, 1, 1, 0), recovery_action=0))
    assert not reset
    w, reset = next_reset_watch(w, HealthReading(remapped_rows=(0, 1, 0, 0), recovery_action=0))
    assert reset and w == ResetWatch()


def test_recovery_action_back_to_none_is_a_reset_and_a_flag_not_read_is_not_clear() -> None:
    w, _ = next_reset_watch(ResetWatch(), HealthReading(recovery_action=1, remapped_rows=(0, 0, 1, 0)))
    w, reset = next_reset_watch(w, HealthReading(recovery_action=0))  # remap not read this time
    assert not reset
    w, reset = next_reset_watch(w, HealthReading(recovery_action=0, remapped_rows=(0, 0, 0, 0)))
    assert reset


def test_lost_then_readable_is_a_reset() -> None:
    w, reset = next_reset_watch(ResetWatch(), HealthReading(lost=True))
    assert not reset and w.seen == {"lost"}
    _, reset = next_reset_watch(w, HealthReading(mig_current=0))
    assert reset


def test_volatile_ecc_going_down_is_a_reset() -> None:
    w, reset = next_reset_watch(ResetWatch(), HealthReading(ecc_uncorrected_volatile=4))
    w, reset = next_reset_watch(w, HealthReading(ecc_uncorrected_volatile=5))
    assert not reset
    _, reset = next_reset_watch(w, HealthReading(ecc_uncorrected_volatile=0))
    assert reset


def test_nothing_ever_seen_set_is_never_a_reset() -> None:
    """After an Xid whose readings never showed a reset-clearing flag, only the operator
    clears it: all-clear readings prove nothing."""
    w = ResetWatch()
    for _ in range(5):
        w, reset = next_reset_watch(w, HealthReading(remapped_rows=(0, 0, 0, 0), recovery_action=0,
                                                      ecc_uncorrected_volatile=0))
        assert not reset


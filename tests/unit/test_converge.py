from __future__ import annotations

from llmgw.agent.lifecycle.converge import Start, Stop, converge
from llmgw.model.engine import EngineKind, EngineSpec


def spec(rid: str, gen: int = 1) -> EngineSpec:
    return EngineSpec(rid, gen, "dep", "org/m", "m", EngineKind.SIMULATED, (), 20000)


def test_starts_what_is_missing() -> None:
    assert converge((spec("a"), spec("b")), {}) == (Start(spec("a")), Start(spec("b")))


def test_leaves_matching_alone() -> None:
    assert converge((spec("a", 3),), {"a": 3}) == ()


def test_stops_what_is_not_wanted() -> None:
    assert converge((), {"a": 1}) == (Stop("a", 1, "no longer in the desired set"),)


def test_changed_generation_is_stop_then_start() -> None:
    actions = converge((spec("a", 2),), {"a": 1})
    assert actions == (Stop("a", 1, "replaced by generation 2"), Start(spec("a", 2)))


def test_stops_come_before_starts_and_order_is_stable() -> None:
    actions = converge((spec("z"), spec("b", 2)), {"c": 1, "b": 1, "a": 1})
    assert [type(a).__name__ for a in actions] == ["Stop", "Stop", "Stop", "Start", "Start"]
    assert [a.replica_id for a in actions if isinstance(a, Stop)] == ["a", "b", "c"]
    assert [a.spec.replica_id for a in actions if isinstance(a, Start)] == ["b", "z"]


def test_idempotent_after_applying() -> None:
    desired = (spec("a", 2), spec("b"))
    running = {"a": 1, "c": 5}
    for action in converge(desired, running):
        if isinstance(action, Stop):
            del running[action.replica_id]
        else:
            running[action.spec.replica_id] = action.spec.generation
    assert running == {"a": 2, "b": 1}
    assert converge(desired, running) == ()


def test_duplicate_replica_keeps_highest_generation() -> None:
    assert converge((spec("a", 1), spec("a", 4)), {}) == (Start(spec("a", 4)),)



def test_an_engine_that_exited_is_not_restarted_for_the_same_generation() -> None:
    assert converge((spec("a", 1),), {}, {"a": 1}) == ()
    # A new generation is the server's way of asking for a restart.
    assert converge((spec("a", 2),), {}, {"a": 1}) == (Start(spec("a", 2)),)

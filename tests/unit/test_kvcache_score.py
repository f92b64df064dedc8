"""Choosing a replica: w * uncached prefill blocks + load."""

from __future__ import annotations

from llmgw.kvcache.score import choose, scores


def test_the_replica_holding_the_prefix_wins_while_its_load_is_worth_it() -> None:
    loads = {"a": 3.0, "b": 0.0}
    # 10 blocks, a holds 8 of them: a scores 0.5*2+3 = 4, b 0.5*10+0 = 5.
    assert scores({"a": 8}, 10, loads, 0.5) == {"a": 4.0, "b": 5.0}
    assert choose({"a": 8}, 10, loads, 0.5) == "a"
    # With blocks worth less, b's empty queue wins.
    assert choose({"a": 8}, 10, loads, 0.1) == "b"


def test_no_prefix_anywhere_is_least_loaded() -> None:
    assert choose({}, 10, {"a": 2.0, "b": 1.0, "c": 5.0}, 1.0) == "b"


def test_ties_go_to_lower_load_then_the_smaller_id() -> None:
    # a: 1*1 + 1 = 2, b: 1*2 + 0 = 2; b has the lower load.
    assert choose({"a": 1}, 2, {"a": 1.0, "b": 0.0}, 1.0) == "b"
    assert choose({}, 2, {"b": 1.0, "a": 1.0}, 1.0) == "a"


def test_only_candidates_count_and_matches_are_clamped() -> None:
    # A replica the index knows but that is not a candidate (ejected, draining) is ignored;
    # a match longer than the request (a stale figure) counts as the whole request.
    assert choose({"gone": 10, "a": 50}, 10, {"a": 1.0, "b": 0.0}, 1.0) == "a"
    assert scores({"a": 50, "b": -3}, 10, {"a": 0.0, "b": 0.0}, 1.0) == {"a": 0.0, "b": 10.0}
    assert choose({"a": 3}, 5, {}, 1.0) is None

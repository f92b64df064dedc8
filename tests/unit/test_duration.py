from __future__ import annotations

import pytest

from llmgw.config.duration import duration_from_value, format_duration, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("5s", 5.0),
        ("1m", 60.0),
        ("2h", 7200.0),
        ("1m30s", 90.0),
        ("1h2m3s", 3723.0),
        ("1s500ms", 1.5),
        ("0.5s", 0.5),
        ("1.5m", 90.0),
        ("0s", 0.0),
        (" 5s ", 5.0),
        ("250ms", 0.25),
    ],
)
def test_parse(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("5", "no unit"),
        ("1.5", "no unit"),
        ("", "empty"),
        ("-5s", "negative"),
        ("5x", "cannot read"),
        ("s", "cannot read"),
        ("5 s", "cannot read"),
        ("5S", "cannot read"),
        ("5s5s", "repeats"),
        ("fast", "cannot read"),
        ("1d", "cannot read"),
        ("5s junk", "cannot read"),
    ],
)
def test_parse_rejects(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment) as info:
        parse_duration(text)
    assert repr(text) in str(info.value) or not text


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("5s", 5.0), (5, 5.0), (2.5, 2.5), (0, 0.0)],
)
def test_value_numbers_are_seconds(value: object, seconds: float) -> None:
    assert duration_from_value(value) == seconds


@pytest.mark.parametrize("value", [True, None, [5], -1, -0.5, float("nan"), float("inf")])
def test_value_rejects(value: object) -> None:
    with pytest.raises(ValueError):
        duration_from_value(value)


@pytest.mark.parametrize("seconds", [0.25, 0.5, 1.0, 5.0, 60.0, 90.0, 7200.0, 1.5])
def test_format_round_trips(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) == seconds

"""llmgw.rlimit: the soft open-file limit goes up to the hard one at a daemon's start."""

from __future__ import annotations

import logging
import resource

import pytest

from llmgw.rlimit import UNLIMITED_TARGET, raise_nofile, target


class FakeLimits:
    def __init__(self, soft: int, hard: int, fail: bool = False) -> None:
        self.soft, self.hard, self.fail = soft, hard, fail
        self.sets: list[tuple[int, int]] = []

    def get(self, which: int) -> tuple[int, int]:
        assert which == resource.RLIMIT_NOFILE
        return self.soft, self.hard

    def set(self, which: int, value: tuple[int, int]) -> None:
        assert which == resource.RLIMIT_NOFILE
        if self.fail:
            raise ValueError("not allowed")
        self.sets.append(value)
        self.soft, self.hard = value


def test_raised_to_the_hard_limit_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    lim = FakeLimits(1024, 524288)
    with caplog.at_level(logging.INFO, "llmgw.rlimit"):
        assert raise_nofile("router", lim.get, lim.set) == 524288
    assert lim.sets == [(524288, 524288)]
    assert "raised from 1024 to 524288" in caplog.text


def test_already_at_the_hard_limit_is_left_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    lim = FakeLimits(20000, 20000)
    with caplog.at_level(logging.INFO, "llmgw.rlimit"):
        assert raise_nofile("server", lim.get, lim.set) == 20000
    assert lim.sets == []
    assert "open-file limit 20000" in caplog.text


def test_unlimited_hard_asks_for_nr_open() -> None:
    lim = FakeLimits(1024, resource.RLIM_INFINITY)
    assert raise_nofile("router", lim.get, lim.set) == UNLIMITED_TARGET
    assert lim.sets == [(UNLIMITED_TARGET, resource.RLIM_INFINITY)]


def test_a_refused_raise_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    lim = FakeLimits(1024, 4096, fail=True)
    with caplog.at_level(logging.WARNING, "llmgw.rlimit"):
        assert raise_nofile("router", lim.get, lim.set) == 1024
    assert "stays 1024" in caplog.text


def test_target_never_lowers() -> None:
    assert target(8192, 4096) == 8192
    assert target(resource.RLIM_INFINITY, resource.RLIM_INFINITY) == resource.RLIM_INFINITY
    assert target(100, 200) == 200


def test_the_real_call_leaves_soft_at_hard() -> None:
    raise_nofile("test")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == (hard if hard != resource.RLIM_INFINITY else soft)

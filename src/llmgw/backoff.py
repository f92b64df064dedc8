"""Backoff delays, pure: exponential from `base` to `cap` (the server's restart delays for a
failed replica), and with jitter (agents reconnecting, so that a fleet that lost the server
together does not come back in lockstep)."""

from __future__ import annotations


def exponential(attempt: int, base: float, cap: float) -> float:
    """`base` doubled `attempt` times (0-based), at most `cap`."""
    return min(cap, base * (2.0 ** min(attempt, 62)))


def backoff_delay(attempt: int, base: float, cap: float, rnd: float) -> float:
    """Delay before reconnect attempt `attempt` (0-based); `rnd` uniform in [0, 1).

    "Equal jitter": half the exponential step is kept, half is random, so the delay
    never collapses to zero and never exceeds `cap`.
    """
    step = exponential(attempt, base, cap)
    return step / 2 + rnd * step / 2

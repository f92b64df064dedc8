"""Reconnect delays: exponential from `base` to `cap`, with jitter so that a fleet of
agents that lost the server together does not come back in lockstep."""

from __future__ import annotations


def backoff_delay(attempt: int, base: float, cap: float, rnd: float) -> float:
    """Delay before reconnect attempt `attempt` (0-based); `rnd` uniform in [0, 1).

    "Equal jitter": half the exponential step is kept, half is random, so the delay
    never collapses to zero and never exceeds `cap`.
    """
    step = min(cap, base * (2.0 ** min(attempt, 62)))
    return step / 2 + rnd * step / 2

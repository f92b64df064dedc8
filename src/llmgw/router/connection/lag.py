"""How late the router's own loop is: a timer's actual wake-up against its due time.

A timeout says something about an engine only if the router was there to see the answer
come. In a burst the loop can be seconds behind (thousands of requests parsed, relayed and
dialled in one go): a connect the kernel completed in a millisecond is noticed only when
the loop comes round, after the deadline. `LagMeter` keeps the recent late wake-ups of a
ticker (`watch_lag`) so that a timeout can ask how much of its window the loop spent
elsewhere (`late_between`) and not charge the engine for it.

Pure core: `LagMeter` is data in (due and actual times), figures out; `watch_lag` is the
thin trio loop that feeds it.
"""

from __future__ import annotations

import math
from collections import deque

import trio

TICK = 0.05  # the ticker's period; lateness finer than a tick is still seen (per wake-up)
NOISE = 0.002  # wake-ups later than this are kept; the scheduler's own jitter is not
KEEP = 4096  # late wake-ups kept (bounded; at one per tick that is minutes of history)


class LagMeter:
    __slots__ = ("due", "_marks", "total", "last", "worst_at", "worst")

    def __init__(self) -> None:
        self.due = math.inf  # when the ticker is due next (inf: not running)
        self._marks: deque[tuple[float, float]] = deque(maxlen=KEEP)  # (woke at, late by)
        self.total = 0.0  # seconds late in all, for the metrics
        self.last = 0.0  # the last wake-up's lateness
        self.worst = 0.0  # the worst lateness since `worst_at`, for the metrics gauge
        self.worst_at = 0.0

    def record(self, due: float, actual: float) -> None:
        late = actual - due
        self.last = late
        if late > NOISE:
            self._marks.append((actual, late))
            self.total += late
            if late > self.worst:
                self.worst = late

    def late_now(self, now: float) -> float:
        """How far past its due time the ticker is, not having run yet (0 when on time)."""
        return now - self.due if now > self.due else 0.0

    def late_between(self, start: float, now: float) -> float:
        """Seconds of [start, now] the loop was elsewhere: each late wake-up at t by L
        means nothing ran on time over [t - L, t]; their overlaps with the window summed,
        with the ticker's own pending lateness."""
        spent = 0.0
        due = self.due
        if now > due:
            spent += now - max(due, start)
        for woke, late in reversed(self._marks):
            if woke <= start:
                break
            spent += min(woke, now) - max(woke - late, start)
        return max(0.0, min(spent, now - start))

    def take_worst(self) -> float:
        """The worst lateness since the last call (then reset): the metrics gauge."""
        w, self.worst = max(self.worst, self.last), 0.0
        return w


async def watch_lag(meter: LagMeter, tick: float = TICK) -> None:
    """Wake every `tick` and record how late each wake-up was."""
    try:
        while True:
            due = trio.current_time() + tick
            meter.due = due
            await trio.sleep_until(due)
            meter.record(due, trio.current_time())
    finally:
        meter.due = math.inf

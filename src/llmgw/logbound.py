"""Log lines that a peer cannot make long or many.

Whatever a peer controls (a node id, a reason, a header, a whole message) goes into a log
line through `clip`, which cuts it at `LIMIT` characters and says how much more there was.
Warnings that a peer can cause again and again go through a `Throttle`: the first
`burst` lines for one peer and reason, then one line per `period` with the count of lines
it held back. Both are pure apart from the clock, which is injected.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable

LIMIT = 2048


def clip(value: object, limit: int = LIMIT) -> str:
    """`str(value)`, or `repr` for bytes, cut to `limit` characters with a note of the rest."""
    text = repr(value) if isinstance(value, bytes | bytearray) else str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… {len(text) - limit} more bytes"


class Throttle:
    """Rate limit for repeated log lines, per key (e.g. (peer, reason)).

    Keeps at most `max_keys` keys (the oldest forgotten first), so a peer that makes up
    keys cannot grow it.
    """

    def __init__(
        self,
        burst: int = 5,
        period: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 4096,
    ) -> None:
        self.burst = burst
        self.period = period
        self.clock = clock
        self.max_keys = max_keys
        # key -> [lines let through in this period, held back since the last line, period start]
        self._seen: dict[Hashable, list[float]] = {}

    def allow(self, key: Hashable) -> tuple[bool, int]:
        """Whether to write the line now, and how many lines were held back before it."""
        now = self.clock()
        entry = self._seen.get(key)
        if entry is None:
            if len(self._seen) >= self.max_keys:
                self._seen.pop(next(iter(self._seen)))
            self._seen[key] = [1, 0, now]
            return True, 0
        passed, held, since = entry
        if passed < self.burst:
            entry[0] += 1
            return True, 0
        if now - since >= self.period:
            entry[1], entry[2] = 0, now
            return True, int(held)
        entry[1] += 1
        return False, 0

    def log(
        self,
        logger: logging.Logger,
        level: int,
        key: Hashable,
        fmt: str,
        *args: object,
        exc_info: bool = False,
    ) -> bool:
        """Log `fmt % args` (each argument clipped) unless `key` is over its rate."""
        ok, held = self.allow(key)
        if not ok:
            return False
        clipped = tuple(a if isinstance(a, int | float) else clip(a) for a in args)
        if held:
            logger.log(level, fmt + " (%d more like this not logged)", *clipped, held, exc_info=exc_info)
        else:
            logger.log(level, fmt, *clipped, exc_info=exc_info)
        return True

    def bug(self, logger: logging.Logger, key: Hashable, fmt: str, *args: object) -> bool:
        """A failure of ours, inside an `except`: at ERROR with its traceback, rate-limited
        per key like any other line (a peer that triggers it again and again fills no disk)."""
        return self.log(logger, logging.ERROR, key, fmt, *args, exc_info=True)

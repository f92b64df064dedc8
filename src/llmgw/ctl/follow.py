"""`ctl logs -f`: what is new in a log tail fetched again. Pure: lists in, lists out."""

from __future__ import annotations

from llmgw.transport.requests import MAX_LOG_LINES

# Lines each fetch of `logs -f` asks for: enough overlap between two fetches a second
# apart to find where the new lines start.
FOLLOW_WINDOW = 1000


def follow_window(lines: int) -> int:
    return min(MAX_LOG_LINES, max(lines, FOLLOW_WINDOW))


def new_lines(prev: list[str], cur: list[str]) -> tuple[list[str], bool]:
    """The lines of `cur` (a later tail of the same log) that `prev` did not have, and
    whether some may be missing: no overlap at all means the log was rotated or grew by
    more than a window between the fetches.

    The overlap is the longest end of `prev` that `cur` starts with. A log that repeats
    one line over and over can hide new copies of it; nothing better can be told from
    two tails."""
    for k in range(min(len(prev), len(cur)), 0, -1):
        if prev[len(prev) - k:] == cur[:k]:
            return cur[k:], False
    return cur, bool(prev) and bool(cur)

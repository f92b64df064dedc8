"""`ctl logs -f`: which lines of a fetched tail are new (ctl/follow.py), and the loop
that prints them, over a fake server on trio's autojump clock."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from llmgw.ctl.commands import follow_logs
from llmgw.ctl.follow import follow_window, new_lines
from llmgw.transport.requests import LogsOp


@pytest.mark.parametrize(("prev", "cur", "new", "gap"), [
    ([], [], [], False),
    ([], ["a"], ["a"], False),
    (["a", "b"], ["a", "b"], [], False),
    (["a", "b"], ["a", "b", "c"], ["c"], False),
    (["a", "b", "c"], ["b", "c", "d", "e"], ["d", "e"], False),  # the window moved on
    (["x", "y"], ["p", "q"], ["p", "q"], True),  # rotated, or more than a window between
    (["b", "b"], ["b", "b", "b"], ["b"], False),
])
def test_new_lines(prev: list[str], cur: list[str], new: list[str], gap: bool) -> None:
    assert new_lines(prev, cur) == (new, gap)


def test_follow_window() -> None:
    assert follow_window(5) == 1000 and follow_window(3000) == 3000 and follow_window(10**6) == 4096


async def test_follow_prints_the_tail_then_what_is_new(autojump_clock: trio.abc.Clock) -> None:
    log = [f"l{i}" for i in range(5)]
    asked: list[LogsOp] = []

    async def ask(op: Any) -> Any:
        asked.append(op)
        if len(asked) == 2:
            log.extend(["n1", "n2"])
        return {"replica": "d-0", "node": "n1", "lines": log[-op.lines:]}

    out: list[str] = []
    with trio.move_on_after(3.5):
        await follow_logs(ask, LogsOp("d-0", 3), 2, interval=1.0, out=out.append)
    assert out == ["# d-0 on n1", "l3", "l4", "n1", "n2"]
    assert len(asked) == 4  # once, then every second

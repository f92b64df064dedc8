"""The router's dial: a connect deadline is moved on by the router's own lateness, once,
and a connect still pending after that is an engine's fault, named with the lateness.

The burst test (test_router_burst.py) shows the whole router under a late loop, but
whether a connect is still pending when the loop comes back depends on the kernel's
timing. Here it is made so: a listener whose accept queue is full drops the SYN (Linux
retries it only after a second), and the lateness is given by a meter that says so.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import trio

from llmgw.router.connection.lag import LagMeter
from llmgw.router.connection.upstream import ConnectFailed, UpstreamPool


class LateBy(LagMeter):
    """A loop that was away `late` seconds in any window it is asked about."""

    def __init__(self, late: float) -> None:
        super().__init__()
        self.late = late

    def late_between(self, start: float, now: float) -> float:
        return self.late


@pytest.fixture
def full_listener() -> Iterator[int]:
    """A port whose listener takes no more connects: its queue is full and never read."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):  # more than a backlog of 0 holds; the last ones stay pending
            c = socket.socket()
            c.setblocking(False)
            try:
                c.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            fillers.append(c)
        yield port
    finally:
        for c in fillers:
            c.close()
        srv.close()


async def test_a_connect_pending_while_the_loop_was_late_is_given_that_time_once(full_listener: int) -> None:
    pool = UpstreamPool(connect_timeout=0.1, lag=LateBy(0.3))
    t0 = trio.current_time()
    with pytest.raises(ConnectFailed) as err:
        await pool.acquire("127.0.0.1", full_listener)
    took = trio.current_time() - t0
    assert pool.forgiven == 1  # the deadline moved on once, by the lateness
    assert "timed out (0.1s, 0.3s of it the router's own lateness)" in str(err.value)
    assert 0.39 <= took < 0.9, took  # the 0.1 s owed plus the 0.3 s the loop was away


async def test_without_lateness_a_pending_connect_times_out_on_time(full_listener: int) -> None:
    pool = UpstreamPool(connect_timeout=0.1, lag=LateBy(0.0))
    t0 = trio.current_time()
    with pytest.raises(ConnectFailed, match=r"timed out \(0.1s\)$"):
        await pool.acquire("127.0.0.1", full_listener)
    assert pool.forgiven == 0
    assert trio.current_time() - t0 < 0.35

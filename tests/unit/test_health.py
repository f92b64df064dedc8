from __future__ import annotations

import functools

import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.lifecycle.health import HealthEvent, HealthTracker, http_health, probe_timeout, watch_health
from llmgw.model.engine import EngineKind


def test_tracker_ready_unhealthy_recover() -> None:
    t = HealthTracker(deadline=100.0)
    assert t.observe(False, 1) is None
    assert t.observe(True, 2) is HealthEvent.READY
    assert t.observe(True, 3) is None
    assert t.observe(False, 4) is None
    assert t.observe(False, 5) is None
    assert t.observe(True, 6) is None  # the run of failures is broken
    assert [t.observe(False, 7 + i) for i in range(3)] == [None, None, HealthEvent.UNHEALTHY]
    assert t.observe(False, 11) is None  # reported once
    assert t.observe(True, 12) is HealthEvent.READY


def test_tracker_startup_timeout_only_before_ready() -> None:
    t = HealthTracker(deadline=10.0)
    assert t.observe(False, 9.9) is None
    assert t.observe(False, 10.0) is HealthEvent.STARTUP_TIMEOUT
    assert t.observe(True, 11) is None
    ready = HealthTracker(deadline=10.0)
    ready.observe(True, 1)
    assert ready.observe(False, 50) is None


class FakeProbe:
    """Answers from a schedule of (from_time, ok) steps, on trio's clock."""

    def __init__(self, steps: list[tuple[float, bool]]) -> None:
        self.steps = steps
        self.calls = 0

    async def __call__(self) -> bool:
        self.calls += 1
        now = trio.current_time()
        ok = False
        for start, value in self.steps:
            if now >= start:
                ok = value
        return ok


async def _run(probe: FakeProbe, until: float, startup: float = 30.0) -> list[tuple[float, str]]:
    events: list[tuple[float, str]] = []
    t0 = trio.current_time()
    with trio.move_on_after(until):
        await watch_health(
            probe, interval=2.0, startup_timeout=startup,
            on_event=lambda e: events.append((trio.current_time() - t0, e.value)),
        )
    return events


async def test_watch_ready_then_unhealthy(autojump_clock: trio.testing.MockClock) -> None:
    probe = FakeProbe([(0, False), (5, True), (20, False)])
    events = await _run(probe, until=40)
    # ready on the first probe at or after 5 s (probes at 0, 2, 4, 6 ...)
    assert events[0] == (6.0, "ready")
    # failures at 20, 22, 24: the third makes it unhealthy
    assert events[1] == (24.0, "unhealthy")
    assert len(events) == 2


async def test_watch_startup_timeout(autojump_clock: trio.testing.MockClock) -> None:
    probe = FakeProbe([(0, False)])
    events = await _run(probe, until=1000, startup=30)
    assert events == [(30.0, "startup_timeout")]
    assert probe.calls == 16  # returns after the timeout: no more probes


async def test_http_health_refused_and_200() -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await stream.receive_some(4096)
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        assert await http_health("127.0.0.1", port) is True
        nursery.cancel_scope.cancel()
    assert await http_health("127.0.0.1", port, timeout=0.5) is False


async def test_http_health_503_and_hang() -> None:
    async def bad(stream: trio.SocketStream) -> None:
        await stream.receive_some(4096)
        await stream.send_all(b"HTTP/1.1 503 Service Unavailable\r\n\r\n")

    async def hang(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        a = (await nursery.start(functools.partial(trio.serve_tcp, bad, 0, host="127.0.0.1")))[0]
        b = (await nursery.start(functools.partial(trio.serve_tcp, hang, 0, host="127.0.0.1")))[0]
        assert await http_health("127.0.0.1", a.socket.getsockname()[1]) is False
        with trio.fail_after(2):
            assert await http_health("127.0.0.1", b.socket.getsockname()[1], timeout=0.3) is False
        nursery.cancel_scope.cancel()


def test_probe_timeout_is_the_setting_and_longer_for_sglang() -> None:
    assert probe_timeout(EngineKind.VLLM, {}, 10.0) == 10.0
    assert probe_timeout(EngineKind.SIMULATED, {}, 3.0) == 3.0
    # SGLang's /health waits up to SGLANG_HEALTH_CHECK_TIMEOUT (20 s) for a token
    assert probe_timeout(EngineKind.SGLANG, {}, 10.0) == 25.0
    assert probe_timeout(EngineKind.SGLANG, {}, 40.0) == 40.0
    assert probe_timeout(EngineKind.SGLANG, {"SGLANG_HEALTH_CHECK_TIMEOUT": "120"}, 10.0) == 125.0


@given(st.text(max_size=30))
def test_probe_timeout_never_raises_on_the_deployments_value(value: str) -> None:
    got = probe_timeout(EngineKind.SGLANG, {"SGLANG_HEALTH_CHECK_TIMEOUT": value}, 10.0)
    assert 10.0 <= got < float("inf")


async def test_watch_health_asks_the_deadline_until_ready(
        autojump_clock: trio.testing.MockClock) -> None:
    asked: list[float] = []

    def deadline(now: float) -> float:
        asked.append(now)
        return 1e9

    probe = FakeProbe([(0, False), (7, True), (30, False)])
    events: list[str] = []
    with trio.move_on_after(60):
        await watch_health(probe, interval=2.0, startup_timeout=5.0,
                           on_event=lambda e: events.append(e.value), deadline=deadline)
    assert events == ["ready", "unhealthy"]  # the moving deadline kept it from failing at 5 s
    assert len(asked) == 5  # asked only until ready (probes at 0, 2, 4, 6, 8)

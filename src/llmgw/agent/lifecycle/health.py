"""Engine health: an HTTP/1.1 probe of GET /health (llmgw.http1.client) and the counting around it.

The counting (`HealthTracker`) is pure: it is fed probe results and the time, and says
what changed. `watch_health` is the trio shell that probes every interval.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable, Mapping

import trio
from attrs import define

from llmgw.http1.client import NoAnswer, request
from llmgw.model.engine import EngineKind

log = logging.getLogger(__name__)

FAILURES_TO_UNHEALTHY = 3

# SGLang's /health (the same handler as /health_generate) sends a one-token generation
# and waits for the scheduler's answer up to SGLANG_HEALTH_CHECK_TIMEOUT, 20 s by default,
# in 1 s steps (sgl-project/sglang python/sglang/srt/entrypoints/http_server.py:
# `HEALTH_CHECK_TIMEOUT = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))`, then
# `while time.time() < tic + HEALTH_CHECK_TIMEOUT: await asyncio.sleep(1)`). A probe that
# gives up sooner calls a busy but healthy engine dead: give it that long and a margin.
SGLANG_HEALTH_WAIT = 20.0
SGLANG_MARGIN = 5.0


def probe_timeout(engine: EngineKind, env: Mapping[str, str], configured: float) -> float:
    """Seconds one /health probe of `engine` may take: the configured health_timeout, and
    for SGLang at least its own wait (the deployment's SGLANG_HEALTH_CHECK_TIMEOUT where it
    sets one) plus a margin."""
    if engine is not EngineKind.SGLANG:
        return configured
    try:
        own = float(env.get("SGLANG_HEALTH_CHECK_TIMEOUT", SGLANG_HEALTH_WAIT))
    except ValueError:  # SGLang's int() would fail on it too; its default is all we know
        own = SGLANG_HEALTH_WAIT
    if not own >= 0 or own == float("inf"):  # NaN, negative, infinite: SGLang's default
        own = SGLANG_HEALTH_WAIT
    return max(configured, own + SGLANG_MARGIN)


class HealthEvent(enum.StrEnum):
    READY = "ready"  # first 200 (or the first again after being unhealthy)
    UNHEALTHY = "unhealthy"  # three failures in a row once ready
    STARTUP_TIMEOUT = "startup_timeout"  # never ready within the startup timeout


@define
class HealthTracker:
    """Pure counting of probe results. `deadline` is when startup gives up."""

    deadline: float
    ready: bool = False
    healthy: bool = False
    failures: int = 0
    timed_out: bool = False

    def observe(self, ok: bool, now: float) -> HealthEvent | None:
        if self.timed_out:
            return None
        if ok:
            self.failures = 0
            if not self.healthy:
                self.ready = True
                self.healthy = True
                return HealthEvent.READY
            return None
        self.failures += 1
        if not self.ready:
            if now >= self.deadline:
                self.timed_out = True
                return HealthEvent.STARTUP_TIMEOUT
            return None
        if self.healthy and self.failures >= FAILURES_TO_UNHEALTHY:
            self.healthy = False
            return HealthEvent.UNHEALTHY
        return None


Probe = Callable[[], Awaitable[bool]]


def key_headers(key: str) -> tuple[tuple[str, str], ...]:
    """The header that carries an engine's own key (engine keys; none for ""): on every call
    the agent makes to an engine, /health too, which both engines leave open (one rule
    for every call costs nothing there)."""
    return (("Authorization", f"Bearer {key}"),) if key else ()


async def http_health(host: str, port: int, *, timeout: float = 2.0, path: str = "/health",
                      key: str = "") -> bool:
    """True when GET `path` answers 200 within `timeout`. Refused, hung or other: False."""
    try:
        status, _ = await request(host, port, "GET", path, timeout=timeout, head_only=True,
                                  headers=key_headers(key), user_agent="llmgw-agent")
    except NoAnswer as exc:
        log.debug("GET http://%s:%d%s: %s", host, port, path, exc)
        return False
    return status == 200


async def watch_health(
    probe: Probe,
    *,
    interval: float,
    startup_timeout: float,
    on_event: Callable[[HealthEvent], None],
    deadline: Callable[[float], float] | None = None,
) -> None:
    """Probe every `interval` forever; call `on_event` on each change.

    `deadline(now)`, when given, says when startup gives up as of `now` (asked after each
    probe, so that progress can move it); else `startup_timeout` from the first probe.
    Returns after a startup timeout (nothing more to watch: the caller stops the engine).
    """
    tracker = HealthTracker(deadline=trio.current_time() + startup_timeout)
    while True:
        ok = await probe()
        now = trio.current_time()
        if deadline is not None and not tracker.ready:
            tracker.deadline = deadline(now)
        event = tracker.observe(ok, now)
        if event is not None:
            on_event(event)
            if event is HealthEvent.STARTUP_TIMEOUT:
                return
        await trio.sleep(interval)

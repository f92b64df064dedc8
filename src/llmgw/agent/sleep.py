"""Putting a vLLM engine to sleep and waking it (issue 25, autoscale.sleep_when_idle).

vLLM 0.32 (entrypoints/serve/dev/sleep/api_router.py, mounted only with
VLLM_SERVER_DEV_MODE=1; the engine started with --enable-sleep-mode):
- `POST /sleep?level=1`: weights to CPU memory, KV cache dropped, GPU memory freed;
  answers {"status": "sleeping", "level": 1} once done. Requests that arrive while it
  sleeps are queued by its paused scheduler, not refused.
- `POST /wake_up`: memory back; {"status": "awake"} (or "sleeping" when only some tags
  woke).
- `GET /is_sleeping`: {"is_sleeping": bool}; the engine is ready again when it says false.

`sleep_action` is the rule (pure); `sleep` and `wake` are the calls, each bounded.
"""

from __future__ import annotations

import json
from enum import StrEnum

import trio

from llmgw.agent.adapter_sync import call
from llmgw.errors import EngineError

SLEEP_LEVEL = 1  # weights kept in CPU memory: the wake is a copy back, not a reload
POLL = 0.02  # seconds between /is_sleeping while waking: the wake is meant to take ~0.1-0.4 s


class SleepAction(StrEnum):
    SLEEP = "sleep"
    WAKE = "wake"


def sleep_action(wanted_asleep: bool, is_sleeping: bool | None) -> SleepAction | None:
    """What to ask of an engine that should (not) sleep, given what /is_sleeping said
    (None: not asked yet, or no answer: ask as if it were the other way, both calls are
    idempotent in vLLM)."""
    if wanted_asleep and is_sleeping is not True:
        return SleepAction.SLEEP
    if not wanted_asleep and is_sleeping is not False:
        return SleepAction.WAKE
    return None


async def is_sleeping(host: str, port: int, *, timeout: float = 5.0) -> bool:
    status, body = await call(host, port, "GET", "/is_sleeping", timeout=timeout)
    if status != 200:
        raise EngineError(f"GET /is_sleeping: HTTP {status} (is VLLM_SERVER_DEV_MODE=1 set?)")
    try:
        value = json.loads(body)["is_sleeping"]
    except (ValueError, KeyError, TypeError):
        raise EngineError(f"GET /is_sleeping: not the answer vLLM gives: {body[:200]!r}") from None
    if not isinstance(value, bool):
        raise EngineError(f"GET /is_sleeping: is_sleeping is {value!r}, not a boolean")
    return value


async def sleep(host: str, port: int, *, timeout: float = 60.0) -> None:
    """Free the engine's GPU memory (level 1); returns once vLLM says it sleeps."""
    status, body = await call(host, port, "POST", f"/sleep?level={SLEEP_LEVEL}", timeout=timeout)
    if status != 200:
        raise EngineError(f"POST /sleep: HTTP {status}: {body[:200]!r}")


async def wake(host: str, port: int, *, timeout: float = 60.0) -> float:
    """Wake the engine and wait until /is_sleeping says false; the seconds it took."""
    start = trio.current_time()
    with trio.move_on_after(timeout) as scope:
        status, body = await call(host, port, "POST", "/wake_up", timeout=timeout)
        if status != 200:
            raise EngineError(f"POST /wake_up: HTTP {status}: {body[:200]!r}")
        # Polled: the engine's own word is the only event there is.
        while True:
            if not await is_sleeping(host, port, timeout=timeout):
                break
            await trio.sleep(POLL)
    if scope.cancelled_caught:
        raise EngineError(f"engine still asleep {timeout:g}s after POST /wake_up")
    return trio.current_time() - start

"""Putting a vLLM engine to sleep and waking it (sleep when idle: autoscale.sleep_when_idle).

vLLM 0.32 (entrypoints/serve/dev/sleep/api_router.py, mounted only with
VLLM_SERVER_DEV_MODE=1; the engine started with --enable-sleep-mode):
- `POST /sleep?level=1`: weights to CPU memory, KV cache dropped, GPU memory freed;
  answers 200 once done. Requests that arrive while it sleeps are queued by its paused
  scheduler, not refused.
- `POST /wake_up`: memory back; 200.
- Only the status is read: 0.32 answers {"status": "sleeping", "level": 1} and
  {"status": "awake"|"sleeping", "tags": ...}, but earlier vLLM (entrypoints/serve/
  sleep/api_router.py, and api_server.py before it) answers both with an empty 200;
  whether the engine sleeps is asked of /is_sleeping, which every version answers.
- `GET /is_sleeping`: {"is_sleeping": bool}; the engine is ready again when it says false.

`sleep` and `wake` are the calls, each bounded; `follow` is the supervisor's task for
one engine whose spec's `asleep` changed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import trio

from llmgw.agent.lora.sync import EngineCallError, call
from llmgw.errors import EngineError

log = logging.getLogger(__name__)

SLEEP_LEVEL = 1  # weights kept in CPU memory: the wake is a copy back, not a reload
POLL = 0.02  # seconds between /is_sleeping while waking: the wake is meant to take ~0.1-0.4 s


async def is_sleeping(host: str, port: int, *, timeout: float = 5.0, key: str = "") -> bool:
    status, body = await call(host, port, "GET", "/is_sleeping", timeout=timeout, key=key)
    if status != 200:
        raise EngineError(f"GET /is_sleeping: HTTP {status} (is VLLM_SERVER_DEV_MODE=1 set?)")
    try:
        value = json.loads(body)["is_sleeping"]
    except (ValueError, KeyError, TypeError):
        raise EngineError(f"GET /is_sleeping: not the answer vLLM gives: {body[:200]!r}") from None
    if not isinstance(value, bool):
        raise EngineError(f"GET /is_sleeping: is_sleeping is {value!r}, not a boolean")
    return value


async def sleep(host: str, port: int, *, timeout: float = 60.0, key: str = "") -> None:
    """Free the engine's GPU memory (level 1); returns once vLLM says it sleeps."""
    # mode=wait: vLLM lets the requests it runs finish, queueing new ones, before it sleeps;
    # its default (abort) would kill one that arrived as the autoscaler decided.
    status, body = await call(host, port, "POST", f"/sleep?level={SLEEP_LEVEL}&mode=wait",
                              timeout=timeout, key=key)
    if status != 200:
        raise EngineError(f"POST /sleep: HTTP {status}: {body[:200]!r}")


async def wake(host: str, port: int, *, timeout: float = 60.0, key: str = "") -> float:
    """Wake the engine and wait until /is_sleeping says false; the seconds it took."""
    start = trio.current_time()
    with trio.move_on_after(timeout) as scope:
        status, body = await call(host, port, "POST", "/wake_up", timeout=timeout, key=key)
        if status != 200:
            raise EngineError(f"POST /wake_up: HTTP {status}: {body[:200]!r}")
        # Polled: the engine's own word is the only event there is.
        while True:
            if not await is_sleeping(host, port, timeout=timeout, key=key):
                break
            await trio.sleep(POLL)
    if scope.cancelled_caught:
        raise EngineError(f"engine still asleep {timeout:g}s after POST /wake_up")
    return trio.current_time() - start


RETRY = 1.0  # seconds between tries when the engine did not answer


async def follow(host: str, port: int, replica_id: str, wanted: Callable[[], bool | None],
                 key: str = "") -> None:
    """Sleep or wake the engine until it is as `wanted()` says (read again after each
    call: the server may change its mind meanwhile); None: the engine is gone, stop.
    `key`: the engine's own API key (the dev endpoints are behind it)."""
    done: bool | None = None
    while True:
        target = wanted()
        if target is None or target == done:
            return
        try:
            if target:
                await sleep(host, port, key=key)
                log.info("engine %s asleep", replica_id)
            else:
                took = await wake(host, port, key=key)
                log.info("engine %s awake in %.3fs", replica_id, took)
        except (EngineError, EngineCallError, OSError) as exc:
            log.warning("engine %s: could not %s it: %s; trying again", replica_id,
                        "sleep" if target else "wake", exc)
            await trio.sleep(RETRY)
            continue
        done = target

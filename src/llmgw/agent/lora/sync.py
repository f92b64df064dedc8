"""The trio shell around adapters.py: ask a running engine which LoRA adapters it has,
load and unload until it has the wanted ones, say what came of it.

One short HTTP/1.1 exchange per call (Connection: close, llmgw.http1.client), as the
health probe does: these
calls are rare (an engine turning ready, a deployment's adapters changing) and must not
share a connection with anything that could hold it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import trio

from llmgw.agent.lifecycle.health import key_headers
from llmgw.agent.lora.adapters import (
    MODELS_PATH,
    AdapterAction,
    SyncResult,
    adapter_actions,
    after,
    answer_error,
    loaded_adapters,
)
from llmgw.http1.client import NoAnswer, request
from llmgw.http1.grammar import H1Error
from llmgw.http1.response import ResponseParser
from llmgw.model.engine import Adapter

log = logging.getLogger(__name__)

MAX_ANSWER = 1 << 20  # a /v1/models list of hundreds of adapters is well under this
# A load reads the adapter's weights and hands them to every worker: seconds for a big
# one on a busy engine.
LOAD_TIMEOUT = 120.0
LIST_TIMEOUT = 10.0


class EngineCallError(Exception):
    """The engine could not be asked (refused, hung, garbled): nothing was learnt."""


async def call(host: str, port: int, method: str, path: str, payload: Any = None, *,
               timeout: float, key: str = "") -> tuple[int, bytes]:
    """(status, body) of one request; EngineCallError when no answer came. `key`: the
    engine's own API key (engine keys), sent as `Authorization: Bearer`."""
    body = b"" if payload is None else json.dumps(payload).encode()
    headers: tuple[tuple[str, str], ...] = (("Accept", "application/json"), *key_headers(key))
    if payload is not None:
        headers += (("Content-Type", "application/json"),)
    try:
        return await request(host, port, method, path, body, timeout=timeout, headers=headers,
                             max_answer=MAX_ANSWER, user_agent="llmgw-agent")
    except NoAnswer as exc:
        raise EngineCallError(f"{method} {path}: {exc}") from None


def parse_answer(raw: bytes, what: str) -> tuple[int, bytes]:
    """A whole HTTP/1.1 answer read to the close: its status and its (de-chunked) body."""
    parser = ResponseParser()
    parser.feed(raw)
    parser.eof()
    try:
        head = parser.head()
        body = parser.body()
    except H1Error as exc:
        raise EngineCallError(f"{what}: not an HTTP answer: {exc.message}") from None
    assert head is not None and body is not None  # at EOF: whole, or an error
    return head.status, body


async def sync_adapters(host: str, port: int, served_name: str, wanted: tuple[Adapter, ...],
                        *, rid: str = "", key: str = "") -> SyncResult:
    """Load and unload on the engine at host:port until it has `wanted`; what it has then.
    EngineCallError when its list of models could not be read (nothing was changed)."""
    status, body = await call(host, port, "GET", MODELS_PATH, timeout=LIST_TIMEOUT, key=key)
    if status != 200:
        raise EngineCallError(f"GET {MODELS_PATH}: {answer_error(status, body)}")
    try:
        loaded = loaded_adapters(body, served_name)
    except ValueError as exc:
        raise EngineCallError(str(exc)) from None
    done: dict[AdapterAction, str] = {}
    for action in adapter_actions(wanted, loaded):
        path, payload = action.request()
        try:
            status, answer = await call(host, port, "POST", path, payload, timeout=LOAD_TIMEOUT,
                                        key=key)
            err = answer_error(status, answer)
        except EngineCallError as exc:
            err = str(exc)
        done[action] = err
        verb = "loaded" if path.endswith("/load_lora_adapter") else "unloaded"
        if err:
            log.warning("engine %s: adapter %s not %s: %s", rid, action.name, verb, err)
        else:
            log.info("engine %s: adapter %s %s", rid, action.name, verb)
    return after(loaded, done, wanted)


# Seconds before adapters that failed to load are tried again (a path mounted late, an
# engine busy loading another); asked again at once on every change of the wanted list.
RETRY_AFTER = 60.0


class AdapterKeeper:
    """One engine's adapters: synced when it turns ready, when the wanted list changes
    (poke), and again every RETRY_AFTER while some failed. `wanted` is asked at each sync
    (the engine's spec may have changed meanwhile); `ready` says whether it serves now;
    `on_result` hears each sync's outcome (on the event loop; it must not block)."""

    def __init__(self, host: str, port: int, rid: str,
                 wanted: Callable[[], tuple[str, tuple[Adapter, ...]]],
                 ready: Callable[[], bool], on_result: Callable[[SyncResult], None],
                 key: str = "") -> None:
        self._host, self._port, self._rid, self._key = host, port, rid, key
        self._wanted, self._ready, self._on_result = wanted, ready, on_result
        self._due = trio.Event()
        self._last = SyncResult((), ())

    def poke(self) -> None:
        self._due.set()

    async def run(self) -> None:
        while True:
            await self._due.wait()
            self._due = trio.Event()
            if not self._ready():
                continue  # turning ready pokes again
            served, wanted = self._wanted()
            try:
                result = await sync_adapters(self._host, self._port, served, wanted, rid=self._rid,
                                             key=self._key)
            except EngineCallError as exc:
                # A busy engine may miss LIST_TIMEOUT: what it had loaded stays routed (the
                # server drops any the spec no longer wants), and the sync is tried again.
                log.warning("engine %s: cannot sync its adapters: %s", self._rid, exc)
                result = SyncResult(self._last.loaded, (f"cannot ask the engine: {exc}",))
            self._last = result
            self._on_result(result)
            if result.errors:
                with trio.move_on_after(RETRY_AFTER):
                    await self._due.wait()
                self._due.set()

"""The API keys the server keeps (API keys and limits), as a router holds them: a table polled like
the endpoint table (every `key_table_interval`, 1 s by default), versioned, kept as it is
while the server is away.

Which keys a router checks: the store's, once the server has sent a table with any key
in it (revoked ones count: a store whose every key is revoked still wants a key);
otherwise the router's own `api_keys_file` if it has one; otherwise none (no client
authentication, as before keys). So `ctl apikey import FILE` moves a router's file into
the store, and from the next poll on the file is not read for requests.

`KeyTable` is pure (no trio, no clock: `now` is passed in, the wall clock's, because an
expiry is a date). `poll_keys` is its trio shell.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from llmgw.errors import ProtocolError
from llmgw.model.apikey import ApiKeyRecord, hash_secret
from llmgw.transport.apikey_ops import KeyTableResult
from llmgw.transport.codec import structure_result

log = logging.getLogger("llmgw.router.keys")

KeySource = Callable[[str], Awaitable[Mapping[str, Any] | None]]
CACHE_MAX = 4096  # Authorization values remembered (garbage ones too: bounded)


class KeyTable:
    def __init__(self) -> None:
        self.version = ""
        self.received = False  # a table came from the server at least once
        self.keys: dict[str, ApiKeyRecord] = {}  # sha256 hex -> key
        self.in_use = False  # the table has a key (read on every request: not a property)
        self._cache: dict[bytes, ApiKeyRecord | None] = {}

    def apply(self, snapshot: Mapping[str, Any]) -> bool:
        """Take the server's answer (peer input: a malformed one raises ProtocolError and
        changes nothing). True when the table changed."""
        snap = structure_result(snapshot, KeyTableResult)
        self.received = True
        if snap.unchanged or snap.version == self.version:
            return False
        keys = {}
        for e in snap.keys:
            keys[e.sha256] = ApiKeyRecord(e.name, e.sha256, "", models=e.models, rpm=e.rpm,
                                          tpm=e.tpm, concurrency=e.concurrency, budget=e.budget,
                                          expires=e.expires, revoked=e.revoked,
                                          on_server_loss=e.on_server_loss,
                                          priority_class=e.priority_class)
        self.keys = keys
        self.in_use = bool(keys)
        self._cache = {}
        self.version = snap.version
        return True

    def check(self, authorization: bytes | None, now: float) -> tuple[ApiKeyRecord | None, str]:
        """The key of an Authorization header value, or None and what to tell the client."""
        key = self._cache.get(authorization) if authorization else None
        if key is not None and key.live(now):
            return key, ""  # the usual case: a key seen before, live
        if not authorization:
            return None, "Missing API key: send Authorization: Bearer <key>."
        if key is None and authorization not in self._cache:
            scheme, _, token = authorization.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                key = self.keys.get(hash_secret(token.strip()))
            if len(self._cache) >= CACHE_MAX:
                self._cache.clear()
            self._cache[authorization] = key
        if key is None:
            return None, "Incorrect API key provided."
        if key.revoked:
            return None, "This API key has been revoked."
        if not key.live(now):
            return None, "This API key has expired."
        return key, ""


async def poll_keys(table: KeyTable, source: KeySource, interval: float, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Poll until cancelled; `started` after the first answer or failure, so that a router
    does not begin serving before it had a chance to learn that keys are wanted."""
    failing = False
    started = False
    while True:
        try:
            snap = await source(table.version)
        except Exception as exc:  # the source is the network: log once, keep the last table
            if not failing:
                log.warning("key table source failed (%s); checking keys against table %s",
                            exc, table.version or "(none yet)")
            failing = True
        else:
            if failing:
                log.info("key table source answers again")
            failing = False
            try:
                if snap is not None and table.apply(snap):
                    log.info("key table %s: %d keys", table.version, len(table.keys))
            except ProtocolError as exc:  # the server's answer is peer input too
                log.warning("ignored a malformed key table (%s); keeping table %s", exc,
                            table.version or "(none yet)")
        if not started:
            started = True
            task_status.started()
        await trio.sleep(interval)

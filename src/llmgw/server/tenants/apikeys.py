"""API keys kept by the server (API keys and limits): the `ctl apikey` ops and the key table routers
poll, over the store (only hashes are kept).

The table's version is a digest of its content, not a counter: a router that polled one
server and then a newly elected leader (or the same server restarted) asks with the
version it has, and is told "unchanged" only when the table really is what it holds.
Revoked keys stay in the table (as "revoked") so that every router tells their clients
so, and so that a store whose every key is revoked still asks routers for a key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import trio
from attrs import evolve

from llmgw.logbound import clip
from llmgw.model.apikey import ApiKeyRecord
from llmgw.server.peers.sessions import Peer, RequestError
from llmgw.server.store.sql import StateStore, StoredEvent
from llmgw.server.tenants.limits import LimitBooks
from llmgw.server.tenants.usage_metrics import UsageTotals
from llmgw.transport.apikey_ops import (
    MAX_KEYS,
    ApiKeyCreateOp,
    ApiKeyImportOp,
    ApiKeyListOp,
    ApiKeyRevokeOp,
    ApiKeyUpdateOp,
    KeyTableOp,
    LeaseOp,
    UsageOp,
    UsageReportOp,
)

Handler = Callable[[Peer, Any, float], Any]
# A router retries a batch for minutes at most: batch ids are kept a day, trimmed hourly.
BATCH_KEEP = 86400.0
BATCH_TRIM_EVERY = 3600.0


def table_entry(k: ApiKeyRecord) -> dict[str, Any]:
    """What a router needs of a key: no prefix, no creation time."""
    e: dict[str, Any] = {"name": k.name, "sha256": k.sha256, "models": list(k.models),
                         "rpm": k.rpm, "tpm": k.tpm, "concurrency": k.concurrency,
                         "budget": k.budget.plain() if k.budget else None,
                         "expires": k.expires, "revoked": k.revoked}
    if k.on_server_loss:  # only when set: a router from before reads the rest
        e["on_server_loss"] = k.on_server_loss
    if k.priority_class:  # likewise
        e["priority_class"] = k.priority_class
    return e


def listing(k: ApiKeyRecord, now: float) -> dict[str, Any]:
    """A key as `ctl apikey list|describe` shows it (never its hash)."""
    return {"name": k.name, "prefix": k.prefix, "state": k.state(now), "models": list(k.models),
            "rpm": k.rpm, "tpm": k.tpm, "concurrency": k.concurrency,
            "budget": k.budget.plain() if k.budget else None, "expires": k.expires,
            "created": k.created, "revoked": k.revoked,
            "on_server_loss": k.on_server_loss or "default",
            "priority_class": k.priority_class or "default"}


def table_version(entries: list[dict[str, Any]]) -> str:
    raw = json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


class ApiKeys:
    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.batches_trimmed = 0.0  # when usage batch ids were last forgotten
        self.usage_batches = {"added": 0, "repeated": 0}  # batches from routers
        self.usage_totals = UsageTotals()  # since this server started, for Prometheus
        self.keys: dict[str, ApiKeyRecord] = store.api_keys()
        self.limits = LimitBooks(lambda: self.keys, spent=self._spent)
        self._table: list[dict[str, Any]] = []
        self.version = ""
        self._rebuild()

    def ops(self) -> dict[type, tuple[frozenset[str], Handler]]:
        admin = frozenset({"admin"})
        return {
            ApiKeyCreateOp: (admin, self.op_create),
            ApiKeyUpdateOp: (admin, self.op_update),
            ApiKeyRevokeOp: (admin, self.op_revoke),
            ApiKeyListOp: (admin, self.op_list),
            ApiKeyImportOp: (admin, self.op_import),
            KeyTableOp: (frozenset({"router", "admin"}), self.op_key_table),
            UsageReportOp: (frozenset({"router"}), self.op_usage_report),
            UsageOp: (admin, self.op_usage),
            LeaseOp: (frozenset({"router"}), self.limits.op_lease),
        }

    def _spent(self, key: str, since: float) -> int:
        """Tokens `key` used from the hour holding `since` on (blocking: a thread's)."""
        return sum(r.prompt_tokens + r.completion_tokens
                   for r in self.store.usage(api_key=key, since=since))

    def _rebuild(self) -> None:
        self._table = [table_entry(k) for _, k in sorted(self.keys.items())]
        self.version = table_version(self._table)

    def _get(self, name: str) -> ApiKeyRecord:
        k = self.keys.get(name)
        if k is None:
            raise RequestError(f"no API key named {clip(name, 100)!r}")
        return k

    async def _put(self, keys: list[ApiKeyRecord], now: float, what: str) -> None:
        """Persisted first, then served: a key a router was told of survives a crash."""
        def write() -> None:
            for k in keys:
                self.store.put_api_key(k, now)
            self.store.add_events([StoredEvent(now, "", "", what)])
        await trio.to_thread.run_sync(write)
        for k in keys:
            self.keys[k.name] = k
        self._rebuild()

    def _check_new(self, op: ApiKeyCreateOp, now: float, taken: set[str]) -> ApiKeyRecord:
        if op.name in self.keys or op.name in taken:
            raise RequestError(f"API key {op.name!r} exists; `ctl apikey update` changes it")
        if any(k.sha256 == op.sha256 for k in self.keys.values()):
            raise RequestError(f"API key {op.name!r}: that secret is already another key's")
        if op.expires and op.expires <= now:
            raise RequestError(f"API key {op.name!r}: --expires is in the past")
        if len(self.keys) + len(taken) >= MAX_KEYS:
            raise RequestError(f"the store holds {MAX_KEYS} API keys (revoked ones too), "
                               "the most a router's key table carries")
        return ApiKeyRecord(op.name, op.sha256, op.prefix, created=now, models=op.models,
                            rpm=op.rpm, tpm=op.tpm, concurrency=op.concurrency,
                            budget=op.budget, expires=op.expires,
                            on_server_loss=op.on_server_loss,
                            priority_class=op.priority_class)

    async def op_create(self, peer: Peer, op: ApiKeyCreateOp, now: float) -> Any:
        k = self._check_new(op, now, set())
        await self._put([k], now, f"API key {k.name} created by {peer.identity}")
        return listing(k, now)

    async def op_import(self, peer: Peer, op: ApiKeyImportOp, now: float) -> Any:
        taken: set[str] = set()
        hashes: set[str] = set()
        new = []
        for entry in op.keys:
            if entry.sha256 in hashes:
                raise RequestError(f"API key {entry.name!r}: the same hash is in the file twice")
            new.append(self._check_new(entry, now, taken))
            taken.add(entry.name)
            hashes.add(entry.sha256)
        if new:
            await self._put(new, now, f"{len(new)} API keys imported by {peer.identity}: "
                            + clip(", ".join(k.name for k in new), 300))
        return {"imported": [k.name for k in new]}

    async def op_update(self, peer: Peer, op: ApiKeyUpdateOp, now: float) -> Any:
        k = self._get(op.name)
        if k.revoked:
            raise RequestError(f"API key {op.name!r} is revoked; create a new one")
        if op.expires and op.expires <= now:
            raise RequestError(f"API key {op.name!r}: --expires is in the past")
        changes: dict[str, Any] = {f: getattr(op, f) for f in
                                   ("models", "rpm", "tpm", "concurrency", "expires",
                                    "on_server_loss", "priority_class")
                                   if getattr(op, f) is not None}
        if op.budget is not None:
            changes["budget"] = op.budget
        elif op.clear_budget:
            changes["budget"] = None
        new = evolve(k, **changes)
        if new != k:
            await self._put([new], now, f"API key {k.name} updated by {peer.identity}: "
                            + ", ".join(sorted(changes)))
        return listing(new, now)

    async def op_revoke(self, peer: Peer, op: ApiKeyRevokeOp, now: float) -> Any:
        k = self._get(op.name)
        if not k.revoked:
            k = evolve(k, revoked=now)
            await self._put([k], now, f"API key {k.name} revoked by {peer.identity}")
        return listing(k, now)

    def op_list(self, peer: Peer, op: ApiKeyListOp, now: float) -> Any:
        if op.name:
            return listing(self._get(op.name), now)
        return [listing(k, now) for _, k in sorted(self.keys.items())]

    def op_key_table(self, peer: Peer, op: KeyTableOp, now: float) -> Any:
        if op.since == self.version:
            return {"version": self.version, "unchanged": True}
        return {"version": self.version, "keys": self._table}

    # ---- usage ----

    async def op_usage_report(self, peer: Peer, op: UsageReportOp, now: float) -> Any:
        def add() -> bool:
            added = self.store.add_usage(op.batch_id, op.rows, now)
            if now - self.batches_trimmed > BATCH_TRIM_EVERY:
                self.store.trim_usage_batches(now - BATCH_KEEP)
                self.batches_trimmed = now
            return added
        added = await trio.to_thread.run_sync(add)
        self.usage_batches["added" if added else "repeated"] += 1
        if added:
            self.usage_totals.add(op.rows)
        return {"added": added}

    async def op_usage(self, peer: Peer, op: UsageOp, now: float) -> Any:
        rows = await trio.to_thread.run_sync(lambda: self.store.usage(
            api_key=op.api_key or None, model=op.model or None, since=op.since))
        return [{"api_key": r.api_key, "model": r.model, "hour": r.hour, "status": r.status,
                 "requests": r.requests, "prompt_tokens": r.prompt_tokens,
                 "completion_tokens": r.completion_tokens, "latency_sum": r.latency_sum}
                for r in rows]

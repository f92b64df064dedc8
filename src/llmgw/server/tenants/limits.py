"""The server's side of per-key limits (issue 24): one LeaseBook per (key, limit), leases
granted to routers on their ask (LeaseOp). Why the sum over routers stays within a limit
is server/tenants/leases.py's docstring; the router's side is router/limits.py.

A grant's `ttl` is relative: the router counts it from when it sent its ask, which is no
later than the grant here, so it stops using a lease no later than the book assumes.

Books live in memory. A budget's book, when it is made (the first ask after a start or a
failover, or a period changed), starts from the key's stored usage over the period (by
whole hours, so up to an hour more: conservative), counted as used until a period from
now. Rate books start empty: after a restart or a failover routers may still spend
leases of the old book for up to a ttl.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import trio

from llmgw.model.apikey import ApiKeyRecord
from llmgw.server.peers.sessions import Peer
from llmgw.server.tenants.leases import LeaseBook
from llmgw.transport.apikey_ops import LeaseOp, LimitKind

LEASE_TTL = 10.0  # seconds a router may spend a lease
MINUTE = 60.0
NOT_LIVE_RETRY = 60.0  # a revoked or expired key: the router learns it from its key table


def limit_of(k: ApiKeyRecord, kind: LimitKind) -> tuple[int, float] | None:
    """(units, window seconds) of one of a key's limits; None when it has none."""
    if kind is LimitKind.RPM:
        return (k.rpm, MINUTE) if k.rpm else None
    if kind is LimitKind.TPM:
        return (k.tpm, MINUTE) if k.tpm else None
    return (k.budget.tokens, k.budget.period) if k.budget else None


class LimitBooks:
    def __init__(self, keys: Callable[[], Mapping[str, ApiKeyRecord]], ttl: float = LEASE_TTL,
                 spent: Callable[[str, float], int] | None = None) -> None:
        self.keys = keys
        self.ttl = ttl
        # Tokens a key used since a time, from the store (blocking: run in a thread).
        self.spent = spent
        self.books: dict[tuple[str, LimitKind], LeaseBook] = {}
        self.granted = 0  # leases granted, for the log and tests
        self.refused = 0

    def book(self, k: ApiKeyRecord, kind: LimitKind) -> LeaseBook | None:
        lim = limit_of(k, kind)
        if lim is None:
            self.books.pop((k.name, kind), None)
            return None
        units, window = lim
        b = self.books.get((k.name, kind))
        if b is None or b.window != window:
            b = self.books[(k.name, kind)] = LeaseBook(units, window, self.ttl)
        b.limit = units  # a limit lowered by `ctl apikey update` holds from the next grant on
        return b

    def op_lease(self, peer: Peer, op: LeaseOp, now: float) -> Any:
        for u in op.unused:
            b = self.books.get((u.key, u.kind))
            if b is not None:
                b.give_back(u.grant_id, u.units, now, router=peer.identity)
        if not op.want:
            return {}
        k = self.keys().get(op.key)
        if k is None or not k.live(now):
            self.refused += 1
            return {"retry_after": NOT_LIVE_RETRY}
        fresh = (k.name, op.kind) not in self.books
        b = self.book(k, op.kind)
        if b is None:  # no such limit (any more): as much as asked
            return {"units": op.want, "ttl": self.ttl}
        if fresh and op.kind is LimitKind.BUDGET and self.spent is not None:
            return self._seeded(peer, op, b, now)
        return self._grant(peer, op, b, now)

    async def _seeded(self, peer: Peer, op: LeaseOp, b: LeaseBook, now: float) -> Any:
        spent = self.spent
        assert spent is not None
        used = await trio.to_thread.run_sync(spent, op.key, now - b.window)
        if used > 0:
            # As one grant that ended now: it occupies the budget until a period from now.
            b.grant("(stored usage)", used, now - self.ttl)
        return self._grant(peer, op, b, now)

    def _grant(self, peer: Peer, op: LeaseOp, b: LeaseBook, now: float) -> Any:
        g = b.grant(peer.identity, op.want, now)
        if g is None:
            self.refused += 1
            return {"retry_after": b.retry_after(now)}
        self.granted += 1
        return {"grant_id": g.id, "units": g.units, "ttl": self.ttl}

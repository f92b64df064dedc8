"""The server's side of per-key limits (API keys and limits): one LeaseBook per (key, limit), leases
granted to routers on their ask (LeaseOp). Why the sum over routers stays within a limit
is server/tenants/leases.py's docstring; the router's side is router/tenants/limits.py.

A grant's `ttl` is relative: the router counts it from when it sent its ask, which is no
later than the grant here, so it stops using a lease no later than the book assumes.

Books live in memory, one set per leader's term (this object: a restart or a failover
makes a new one, with a new `term`). A budget's book, when it is made (the first ask of a
term, or a period changed), starts from the key's stored usage over the period (by whole
hours, so up to an hour more: conservative), counted as used until a period from now.
Grants of earlier terms that routers still hold or used are declared to the new term and
adopted (server/tenants/leases.py says why that keeps the sum exact): a router that names
another term is answered `declare` and nothing else until it asks with its grants of
other terms (`held`) under this term's name; and the term grants nothing for HOLD seconds
from its first ask, so that every router holding grants can declare them first (the
router's requests that need a lease meanwhile wait for its end: router/tenants/leases.py). A router
from before terms (its op has no `term`) is answered as before, with none of the new
fields it would refuse.

Concurrency (server/tenants/slots.py): one SlotBook per key with a concurrency. A LeaseOp
of kind CONCURRENCY asks for `want` slots, and its `held` renews the slot grants the
router holds (of this term, or of another: adopted), answered with `kept`. Its hold is
the term's, as for rates. Routers from before slots never send that kind (they count
concurrency alone); a server from before slots refuses the op, and the router then
counts alone too (router/tenants/limits.py).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import trio

from llmgw.model.apikey import ApiKeyRecord
from llmgw.server.peers.sessions import Peer
from llmgw.server.tenants.leases import LeaseBook
from llmgw.server.tenants.slots import SlotBook
from llmgw.transport.apikey_ops import NO_TERM, Held, LeaseOp, LimitKind

LEASE_TTL = 10.0  # seconds a router may spend a lease
# Seconds a slot grant lives unless renewed (routers renew about once a second): how long
# a dead router's slots stay unusable at most.
SLOT_TTL = 10.0
MINUTE = 60.0
NOT_LIVE_RETRY = 60.0  # a revoked or expired key: the router learns it from its key table
# Seconds a new term grants nothing, from its first ask: routers holding grants of the old
# term probe about once a second (router/tenants/leases.py PROBE_EVERY) and reach the new leader
# within about a second of its election, each try of an ask bounded at a second.
HOLD = 2.5


def limit_of(k: ApiKeyRecord, kind: LimitKind) -> tuple[int, float] | None:
    """(units, window seconds) of one of a key's limits; None when it has none."""
    if kind is LimitKind.RPM:
        return (k.rpm, MINUTE) if k.rpm else None
    if kind is LimitKind.TPM:
        return (k.tpm, MINUTE) if k.tpm else None
    if kind is LimitKind.CONCURRENCY:  # slots, not units in a window: SlotBook
        return None
    return (k.budget.tokens, k.budget.period) if k.budget else None


class LimitBooks:
    def __init__(self, keys: Callable[[], Mapping[str, ApiKeyRecord]], ttl: float = LEASE_TTL,
                 spent: Callable[[str, float], int] | None = None, hold: float = HOLD,
                 term: str | None = None, slot_ttl: float = SLOT_TTL) -> None:
        self.keys = keys
        self.ttl = ttl
        self.slot_ttl = slot_ttl
        self.slots: dict[str, SlotBook] = {}  # per key with a concurrency
        # Tokens a key used since a time, from the store (blocking: run in a thread).
        self.spent = spent
        self.books: dict[tuple[str, LimitKind], LeaseBook] = {}
        self.seeded: dict[str, float] = {}  # budget books started from stored usage: period
        self.term = secrets.token_hex(8) if term is None else term
        self.hold = hold
        self.hold_until = -math.inf  # set by the term's first ask of a router that knows terms
        self._held_from: float | None = None
        self.granted = 0  # leases granted, for the log and tests
        self.refused = 0
        self.adopted = 0  # units of other terms' grants adopted, for the log and tests

    def book(self, k: ApiKeyRecord, kind: LimitKind) -> LeaseBook | None:
        lim = limit_of(k, kind)
        if lim is None:
            self.books.pop((k.name, kind), None)
            if kind is LimitKind.BUDGET:
                self.seeded.pop(k.name, None)
            return None
        units, window = lim
        b = self.books.get((k.name, kind))
        if b is None or b.window != window:
            b = self.books[(k.name, kind)] = LeaseBook(units, window, self.ttl, self.hold_until)
        b.limit = units  # a limit lowered by `ctl apikey update` holds from the next grant on
        return b

    def op_lease(self, peer: Peer, op: LeaseOp, now: float) -> Any:
        knows_terms = op.term != ""
        if knows_terms and self._held_from is None:
            self._held_from = now
            self.hold_until = now + self.hold
            for made in self.books.values():  # made for routers from before terms
                made.hold_until = self.hold_until
            for sb in self.slots.values():
                sb.hold_until = self.hold_until
        mine = self.term if knows_terms else ""
        for u in op.unused:
            ub = self.books.get((u.key, u.kind))
            if ub is not None and u.term == mine:  # another term's ids are not this book's
                ub.give_back(u.grant_id, u.units, now, router=peer.identity)
        if knows_terms and op.term not in (NO_TERM, self.term):
            return {"term": self.term, "declare": True}
        if op.kind is LimitKind.CONCURRENCY:
            return self._op_slots(peer, op, now)
        for h in op.held if knows_terms else ():
            hk = self.keys().get(h.key)
            hb = self.book(hk, h.kind) if hk is not None and h.term != self.term else None
            if hb is not None:
                self.adopted += hb.adopt(peer.identity, h.term, h.grant_id, h.units, h.left, now)
        if not op.want:
            return {"term": self.term} if knows_terms else {}
        k = self.keys().get(op.key)
        if k is None or not k.live(now):
            self.refused += 1
            return self._answer(op, {"retry_after": NOT_LIVE_RETRY})
        b = self.book(k, op.kind)
        if b is None:  # no such limit (any more): as much as asked
            return self._answer(op, {"units": op.want, "ttl": self.ttl})
        if op.kind is LimitKind.BUDGET and self.spent is not None and self.seeded.get(k.name) != b.window:
            return self._seeded(peer, op, b, now)
        return self._grant(peer, op, b, now)

    def slot_book(self, k: ApiKeyRecord) -> SlotBook | None:
        if not k.concurrency:
            self.slots.pop(k.name, None)
            return None
        b = self.slots.get(k.name)
        if b is None:
            b = self.slots[k.name] = SlotBook(k.concurrency, self.slot_ttl, self.term, self.hold_until)
        b.limit = k.concurrency  # lowered: holds from the next grant on
        return b

    def _op_slots(self, peer: Peer, op: LeaseOp, now: float) -> dict[str, Any]:
        """Renew the slot grants in `held` (answered `kept`, in order), then grant `want`."""
        result: dict[str, Any] = {}
        if op.held:
            result["kept"] = [self._renew(peer, h, now) for h in op.held]
            result["ttl"] = self.slot_ttl
        if not op.want:
            return self._answer(op, result)
        k = self.keys().get(op.key)
        if k is None or not k.live(now):
            self.refused += 1
            return self._answer(op, {**result, "retry_after": NOT_LIVE_RETRY})
        b = self.slot_book(k)
        if b is None:  # no concurrency (any more): as many as asked, not renewed
            return self._answer(op, {**result, "units": op.want, "ttl": self.slot_ttl})
        got = b.grant(peer.identity, op.want, now)
        if got is None:
            self.refused += 1
            wait = b.retry_after(now)
            if now < b.hold_until and op.term:
                return self._answer(op, {**result, "hold": wait, "retry_after": wait})
            return self._answer(op, {**result, "retry_after": wait})
        self.granted += 1
        return self._answer(op, {**result, "grant_id": got[0], "units": got[1], "ttl": self.slot_ttl})

    def _renew(self, peer: Peer, h: Held, now: float) -> int:
        k = self.keys().get(h.key)
        b = self.slot_book(k) if k is not None and k.live(now) and h.kind is LimitKind.CONCURRENCY else None
        return 0 if b is None else b.renew(peer.identity, h.term, h.grant_id, h.units, now)

    def _answer(self, op: LeaseOp, result: dict[str, Any]) -> dict[str, Any]:
        if op.term:
            result["term"] = self.term
        return result

    async def _seeded(self, peer: Peer, op: LeaseOp, b: LeaseBook, now: float) -> Any:
        spent = self.spent
        assert spent is not None
        used = await trio.to_thread.run_sync(spent, op.key, now - b.window)
        if self.seeded.get(op.key) != b.window:  # not seeded by another ask meanwhile
            self.seeded[op.key] = b.window
            if used > 0:
                # As one grant that ended now: it occupies the budget until a period from
                # now (adopted, so that the hold does not refuse it).
                b.adopt("(stored usage)", self.term, 0, used, 0.0, now)
        return self._grant(peer, op, b, now)

    def _grant(self, peer: Peer, op: LeaseOp, b: LeaseBook, now: float) -> Any:
        g = b.grant(peer.identity, op.want, now)
        if g is None:
            self.refused += 1
            if now < b.hold_until and op.term:
                return self._answer(op, {"hold": b.hold_until - now, "retry_after": b.hold_until - now})
            return self._answer(op, {"retry_after": b.retry_after(now)})
        self.granted += 1
        return self._answer(op, {"grant_id": g.id, "units": g.units, "ttl": self.ttl})

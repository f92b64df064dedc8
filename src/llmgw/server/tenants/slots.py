"""Slots of a key's concurrency for routers (API keys and limits), pure: at most `concurrency`
requests of a key run at once, summed over every router, with no round trip per request.

A key's concurrency is C slots. The server leases slots to routers (a grant of n slots,
named by the leader's term and an id); a router admits a request while it runs fewer
requests than the live slots it holds (router/tenants/slots.py), asks for more when it is full,
and gives back what it did not need in the last second (an idle router holds none). A
grant lasts `ttl` seconds from its grant or its last renewal; a router renews its grants
about once a second while it holds them (router/tenants/leases.py keep_terms). The book grants
only free slots: the slots of its live grants never sum above C.

Why at most C requests run at once on slots (one book): a router counts a grant's ttl
from when it sent the ask or renewal that the server answered, no later than the server
counts it, and a renewal or give-back only lowers a grant's slots (`keep`: the slots the
router keeps, applied by the router before it sends, by the book as a minimum: a repeat
or a late arrival can free nothing the router still uses). So at every instant each
router's live slots are at most what the book counts for it, and the requests it runs
on them at most those: at most C in all. What the bound does not cover, stated:
- a router cut off from the server for longer than a ttl keeps the requests it runs when
  its grants lapse (it cannot stop them); the book frees those slots at the ttl and may
  lease them again. The excess is at most those requests, until they end. A dead router's
  requests died with it: its slots are unusable for at most a ttl, then free again.
- what a router admits beyond its slots under `on_server_loss` (router/tenants/limits.py): by
  default concurrency up to C on that router alone while the server is unreachable.

Across a change of leader (or a restart: books live in memory), the new term's book
starts empty while routers run requests on the old term's slots. It grants nothing until
`hold_until` (server/tenants/limits.py HOLD, as for rates), and meanwhile each router
renews its grants to the new leader (its renewals name the old term): a book adopts a
grant of another term it does not know as live for a ttl from the renewal, with the
slots the router keeps, and renews it afterwards like its own. The old leader grants
nothing once the new term is elected, so from then on the slots of old grants that
routers hold only shrink; each router renews only grants it holds live, which the old
book counted, whose live grants summed to at most C. So once the hold ends, every old
slot still in use was adopted, and the book grants only what is free beside them. The
assumption is the one of rates (leases.py): every router holding old slots reaches the
new leader within the hold. A router that does not (cut off, or late) has its old slots
adopted when it does reach it, on top of what was granted meanwhile: the excess is at
most its slots, until then. What a router adopts is clamped to C per router; a grant of
this term that the book does not know (it lapsed here) is refused (0), never made anew.

Time is passed in; the book is per key, the service keeps one per key with a concurrency.
"""

from __future__ import annotations

import math

from attrs import define

RETRY = 1.0  # seconds a refused router is told to wait: a slot frees when a request ends


@define
class SlotGrant:
    router: str
    slots: int
    ends: float
    adopted: bool = False


class SlotBook:
    """The slot grants of one key: at most `limit` slots leased at once, each grant live
    for `ttl` seconds from its grant or last renewal. `term`: this leader's (names grants)."""

    def __init__(self, limit: int, ttl: float, term: str, hold_until: float = -math.inf) -> None:
        if limit < 0 or ttl <= 0:
            raise ValueError("limit >= 0 and ttl > 0")
        self.limit = limit
        self.ttl = ttl
        self.term = term
        self.hold_until = hold_until  # nothing granted before (a new term's renewals)
        self._grants: dict[tuple[str, int], SlotGrant] = {}  # by (term, grant id)
        self._next = 1
        self.adopted = 0  # slots of other terms' grants adopted, for the log and tests

    def leased(self, now: float) -> int:
        """Slots of live grants at `now`, adopted ones included."""
        self._expire(now)
        return sum(g.slots for g in self._grants.values())

    def grant(self, router: str, want: int, now: float) -> tuple[int, int] | None:
        """(grant id, slots): up to `want` free slots for `router` now; None when none is
        free or the term holds (retry_after says how long to wait)."""
        if now < self.hold_until:
            return None
        n = min(want, self.limit - self.leased(now))
        if n <= 0:
            return None
        gid = self._next
        self._next += 1
        self._grants[(self.term, gid)] = SlotGrant(router, n, now + self.ttl)
        return gid, n

    def renew(self, router: str, term: str, grant_id: int, keep: int, now: float) -> int:
        """`router` keeps `keep` slots of grant (term, grant_id) and renews it for a ttl;
        fewer slots than the grant's give the rest back (0: all). Returns the slots the
        book now counts for it: 0 when it is gone (lapsed here, or another router's).
        A grant of another term the book does not know is adopted (module docstring)."""
        self._expire(now)
        name = (term, grant_id)
        g = self._grants.get(name)
        if g is None:
            return self._adopt(router, name, keep, now) if term != self.term else 0
        if g.router != router:
            return 0
        g.slots = min(g.slots, max(0, keep))
        if g.slots == 0:
            del self._grants[name]
            return 0
        g.ends = now + self.ttl
        return g.slots

    def _adopt(self, router: str, name: tuple[str, int], slots: int, now: float) -> int:
        theirs = sum(g.slots for g in self._grants.values() if g.adopted and g.router == router)
        n = min(slots, self.limit - theirs)
        if n <= 0:
            return 0
        self._grants[name] = SlotGrant(router, n, now + self.ttl, adopted=True)
        self.adopted += n
        return n

    def retry_after(self, now: float) -> float:
        """Seconds until the hold ends, else RETRY (a slot frees when some request ends)."""
        return self.hold_until - now if now < self.hold_until else RETRY

    def _expire(self, now: float) -> None:
        gone = [n for n, g in self._grants.items() if g.ends <= now]
        for n in gone:
            del self._grants[n]

"""Leases of a key's allowance for routers (API keys and limits), pure: exact rate limits across any
number of routers with no round trip per request, and across a change of leader.

A limit is L units (requests or tokens) per `window` seconds, sliding: in no window of
that length may more than L units be used, summed over every router. The server grants
each router slices ("leases") of n units; a router admits locally against what it holds
and asks for more as it runs low. A lease may be used for `ttl` seconds from its grant,
then what is left of it is void.

Why the sum never exceeds L in any window (one book): a unit granted at g is used, if at
all, in [g, g + ttl]; the book counts it as occupying the limit over [g, g + ttl + window).
Every unit used inside a window [a, a + window) therefore still occupies the limit at the
window's last instant, so the units used in the window are at most the units occupying
then, and the book never lets those exceed L (it checks when it grants; occupancy only
ends afterwards). A router that gives back units it did not use (its lease ran out, or it
stops) frees them at once: they were never used, so they are in no window.

Across a change of leader (or a restart: books live in memory), the book of the new term
starts empty while routers hold, and have used, grants of the old one. The argument above
needs one thing only: at every grant, the book counts every unit that truly occupies.
So a new term's book
- grants nothing until `hold_until` (the service sets it a few seconds after the term's
  first ask: server/tenants/limits.py), and
- adopts the grants routers declare (`adopt`): each router remembers every grant it holds
  or used until it stops occupying (router/tenants/wallet.py), and declares those of other terms
  to a leader of a new term before that leader grants it anything (limits.py refuses a
  router that talks of another term until it has declared). A declared grant occupies
  from its adoption for `left` (what the router had left of its use, which it measured
  when it sent, so at least what truly is left) plus a window: no earlier than it
  truly stops.
Then at a grant after the hold, every unit granted in the old term that still occupies
was declared (its router declared during the hold) and is counted, with this term's own
grants; before the hold ends only the old term's grants occupy, at most L by the old
book. The assumption, stated: every router holding grants of the old term reaches the new
leader within the hold (routers probe about once a second while they hold any,
router/tenants/leases.py). A router that does not (it died with the leader, or is cut off from the
new one longer than the hold) can have used at most what the old term granted it and not
declared; that is the bound on the excess, in the windows ending within ttl + window of
the change.

A router cannot make a book grant more by declaring: declarations only add occupancy.
What it declares is clamped (`left` to [-window, ttl], its declared units to L in all)
and named by (router, term, grant id), so a declaration repeated (a retry, a second
probe) replaces itself and adds nothing, and the new term's grant ids never meet the old
ones (adopted grants are kept apart, and a give-back names its term: limits.py).

Time is passed in. A book is per (key, limit); the service keeps one per pair. A router
that goes away may have used its leases up to their end: they occupy until then like any
other. The router's side is router/tenants/wallet.py.
"""

from __future__ import annotations

import math

from llmgw.model.leases import Grant


class LeaseBook:
    """The grants of one limit: `limit` units per `window` seconds, leases of `ttl`."""

    def __init__(self, limit: int, window: float, ttl: float, hold_until: float = -math.inf) -> None:
        if limit < 0 or window <= 0 or ttl <= 0:
            raise ValueError("limit >= 0, window > 0 and ttl > 0")
        self.limit = limit
        self.window = window
        self.ttl = ttl
        self.hold_until = hold_until  # nothing granted before (a new term's declarations)
        self._grants: dict[int, Grant] = {}
        # Grants of other terms that routers declared, by (router, term, grant id).
        self._adopted: dict[tuple[str, str, int], Grant] = {}
        self._given: set[int] = set()  # grants given back in part: a repeat frees nothing more
        self._next = 1

    def occupied(self, now: float) -> int:
        """Units that count against the limit at `now`."""
        self._expire(now)
        return sum(g.units for g in self._grants.values()) + sum(g.units for g in self._adopted.values())

    def grant(self, router: str, want: int, now: float) -> Grant | None:
        """Up to `want` units for `router` now (fewer when the limit is nearly taken); None
        when nothing is left until some occupancy ends, or the hold ends (retry_after says
        when)."""
        if now < self.hold_until:
            return None
        free = self.limit - self.occupied(now)
        n = min(want, free)
        if n <= 0:
            return None
        g = Grant(self._next, router, n, now, now + self.ttl)
        self._next += 1
        self._grants[g.id] = g
        return g

    def adopt(self, router: str, term: str, grant_id: int, units: int, left: float, now: float) -> int:
        """A grant of another term that `router` holds or used: `units` of it occupy until
        `left` seconds of use from now plus a window. Clamped (module docstring); a
        repeat replaces. Returns the units adopted."""
        if units <= 0 or not math.isfinite(left):
            return 0
        name = (router, term, grant_id)
        self._adopted.pop(name, None)
        self._expire(now)
        theirs = sum(g.units for (r, _, _), g in self._adopted.items() if r == router)
        n = min(units, max(0, self.limit - theirs))
        left = min(max(left, -self.window), self.ttl)
        if n <= 0 or now + left + self.window <= now:
            return 0
        self._adopted[name] = Grant(grant_id, router, n, now + left - self.ttl, now + left, term)
        return n

    def give_back(self, grant_id: int, unused: int, now: float, router: str | None = None) -> None:
        """The router did not use, and will not use, `unused` units of the grant (clamped:
        a router cannot free more than it was given; with `router`, nor another's; once
        per grant: an ask retried after a timeout the server did answer repeats it)."""
        g = self._grants.get(grant_id)
        if g is None or unused <= 0 or (router is not None and g.router != router) \
                or grant_id in self._given:
            return
        left = g.units - min(unused, g.units)
        if left:
            self._grants[grant_id] = Grant(g.id, g.router, left, g.granted_at, g.ends)
            self._given.add(grant_id)
        else:
            del self._grants[grant_id]
        self._expire(now)

    def retry_after(self, now: float) -> float:
        """Seconds until some occupancy ends, or the hold (0 when units are free now)."""
        if now < self.hold_until:
            return self.hold_until - now
        if self.occupied(now) < self.limit:
            return 0.0
        ends = [g.occupies_until(self.window) for g in (*self._grants.values(), *self._adopted.values())]
        return max(0.0, min(ends, default=now) - now)

    def _expire(self, now: float) -> None:
        gone = [i for i, g in self._grants.items() if g.occupies_until(self.window) <= now]
        for i in gone:
            del self._grants[i]
            self._given.discard(i)
        if self._adopted:
            old = [n for n, g in self._adopted.items() if g.occupies_until(self.window) <= now]
            for n in old:
                del self._adopted[n]

"""Leases of a key's allowance for routers (issue 24), pure: exact rate limits across any
number of routers with no round trip per request.

A limit is L units (requests or tokens) per `window` seconds, sliding: in no window of
that length may more than L units be used, summed over every router. The server grants
each router slices ("leases") of n units; a router admits locally against what it holds
and asks for more as it runs low. A lease may be used for `ttl` seconds from its grant,
then what is left of it is void.

Why the sum never exceeds L in any window: a unit granted at g is used, if at all, in
[g, g + ttl]; the book counts it as occupying the limit over [g, g + ttl + window). Every
unit used inside a window [a, a + window) therefore still occupies the limit at the
window's last instant, so the units used in the window are at most the units occupying
then, and the book never lets those exceed L (it checks when it grants; occupancy only
ends afterwards). A router that gives back units it did not use (its lease ran out, or it
stops) frees them at once: they were never used, so they are in no window.

Time is passed in. A book is per (key, limit); the service keeps one per pair. A router
that goes away may have used its leases up to their end: they occupy until then like any
other. The router's side is router/wallet.py.
"""

from __future__ import annotations

from llmgw.model.leases import Grant


class LeaseBook:
    """The grants of one limit: `limit` units per `window` seconds, leases of `ttl`."""

    def __init__(self, limit: int, window: float, ttl: float) -> None:
        if limit < 0 or window <= 0 or ttl <= 0:
            raise ValueError("limit >= 0, window > 0 and ttl > 0")
        self.limit = limit
        self.window = window
        self.ttl = ttl
        self._grants: dict[int, Grant] = {}
        self._next = 1

    def occupied(self, now: float) -> int:
        """Units that count against the limit at `now`."""
        self._expire(now)
        return sum(g.units for g in self._grants.values())

    def grant(self, router: str, want: int, now: float) -> Grant | None:
        """Up to `want` units for `router` now (fewer when the limit is nearly taken); None
        when nothing is left until some occupancy ends (retry_after says when)."""
        free = self.limit - self.occupied(now)
        n = min(want, free)
        if n <= 0:
            return None
        g = Grant(self._next, router, n, now, now + self.ttl)
        self._next += 1
        self._grants[g.id] = g
        return g

    def give_back(self, grant_id: int, unused: int, now: float, router: str | None = None) -> None:
        """The router did not use, and will not use, `unused` units of the grant (clamped:
        a router cannot free more than it was given; with `router`, nor another's)."""
        g = self._grants.get(grant_id)
        if g is None or unused <= 0 or (router is not None and g.router != router):
            return
        left = g.units - min(unused, g.units)
        if left:
            self._grants[grant_id] = Grant(g.id, g.router, left, g.granted_at, g.ends)
        else:
            del self._grants[grant_id]
        self._expire(now)

    def retry_after(self, now: float) -> float:
        """Seconds until some occupancy ends (0 when units are free now)."""
        if self.occupied(now) < self.limit:
            return 0.0
        return max(0.0, min(g.occupies_until(self.window) for g in self._grants.values()) - now)

    def _expire(self, now: float) -> None:
        gone = [i for i, g in self._grants.items() if g.occupies_until(self.window) <= now]
        for i in gone:
            del self._grants[i]

"""A router's leases of one limit (API keys and limits), pure: admitted requests spend them locally, no
round trip per request; what ran out is given back to the server (server/tenants/leases.py says
why the sum over routers stays within the limit).

A wallet also remembers, until they stop occupying the limit (their end plus a window),
the grants it holds and the units it used of those that ended: a leader of a new term
knows nothing of them, and the router declares those of other terms to it (`held`) before
it is granted more (leases.py, across a change of leader). What it remembers is bounded:
past MAX_SPENT ended grants, the two oldest of one term become one (their units summed,
the later end): it occupies no less, and no shorter.
"""

from __future__ import annotations

from llmgw.model.leases import Grant

MAX_SPENT = 64  # ended grants remembered per wallet (merged beyond)


class Wallet:
    """A router's side of one limit: the leases it holds, spent oldest first. Pure.
    `window`: the limit's; 0 remembers no ended grants (nothing to declare)."""

    def __init__(self, window: float = 0.0) -> None:
        self.window = window
        self._leases: list[tuple[Grant, int]] = []  # (grant, units left)
        self._spent: list[tuple[Grant, int]] = []  # (ended grant, units used of it)

    def add(self, g: Grant) -> None:
        self._leases.append((g, g.units))

    def available(self, now: float) -> int:
        return sum(left for g, left in self._leases if now < g.ends)

    def spend(self, units: int, now: float) -> bool:
        """Take `units` from live leases (oldest first) or take nothing and answer False."""
        if self._leases:
            g, left = self._leases[0]
            if now < g.ends and left >= units:  # the usual case, without the walk below
                self._leases[0] = (g, left - units)
                return True
        if self.available(now) < units:
            return False
        need = units
        out = []
        for g, left in self._leases:
            if need and now < g.ends:
                take = min(need, left)
                need -= take
                left -= take
            out.append((g, left))
        self._leases = out
        return True

    def refund(self, units: int, now: float) -> None:
        """Units charged at admission and not used (the answer used fewer tokens than
        estimated): back into the live leases, newest first, none above what it was
        granted (a charge spread over several leases goes back over several: into the
        newest alone, all but its size was lost)."""
        leases = self._leases
        if leases:  # the usual case, without the walk below: the newest takes it all
            g, left = leases[-1]
            if now < g.ends and g.units - left >= units:
                leases[-1] = (g, left + units)
                return
        for i in range(len(self._leases) - 1, -1, -1):
            if units <= 0:
                return
            g, left = self._leases[i]
            if now < g.ends and left < g.units:
                back = min(units, g.units - left)
                self._leases[i] = (g, left + back)
                units -= back

    def expired(self, now: float) -> list[tuple[int, int]]:
        """(grant id, units unused) of the leases that ended, removed from the wallet: what
        the router gives back to the server."""
        return [(g.id, left) for g, left in self.ended(now)]

    def ended(self, now: float) -> list[tuple[Grant, int]]:
        """(grant, units unused) of the leases that ended, removed from the wallet; what
        was used of them is remembered while it occupies (`held`)."""
        done = [(g, left) for g, left in self._leases if now >= g.ends]
        if not done:
            return []
        self._leases = [(g, left) for g, left in self._leases if now < g.ends]
        if self.window > 0:
            self._spent = [(g, n) for g, n in self._spent if g.occupies_until(self.window) > now]
            self._spent += [(g, g.units - left) for g, left in done if g.units > left]
            while len(self._spent) > MAX_SPENT and self._merge():
                pass
        return done

    def _merge(self) -> bool:
        g0, n0 = self._spent[0]
        for i in range(1, len(self._spent)):
            g, n = self._spent[i]
            if g.term == g0.term:
                later = g if g.ends >= g0.ends else g0
                self._spent[i] = (later, n + n0)
                del self._spent[0]
                return True
        return False

    def held(self, now: float, term: str) -> list[tuple[Grant, int, float]]:
        """(grant, units that may occupy, seconds of use left: negative when it ended) of
        the grants of terms other than `term` that still occupy at `now`: what the router
        declares to a leader of the term `term`."""
        self.ended(now)
        out = [(g, g.units, g.ends - now) for g, _ in self._leases if g.term != term]
        out += [(g, n, g.ends - now) for g, n in self._spent
                if g.term != term and g.occupies_until(self.window) > now]
        return out

    def remembers(self, now: float) -> bool:
        """Whether it holds a lease or remembers a grant that still occupies."""
        return bool(self._leases) or any(g.occupies_until(self.window) > now for g, _ in self._spent)

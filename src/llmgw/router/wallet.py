"""A router's leases of one limit (issue 24), pure: admitted requests spend them locally, no
round trip per request; what ran out is given back to the server (server/tenants/leases.py says
why the sum over routers stays within the limit)."""

from __future__ import annotations

from llmgw.model.leases import Grant


class Wallet:
    """A router's side of one limit: the leases it holds, spent oldest first. Pure."""

    def __init__(self) -> None:
        self._leases: list[tuple[Grant, int]] = []  # (grant, units left)

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
        done = [(g.id, left) for g, left in self._leases if now >= g.ends]
        self._leases = [(g, left) for g, left in self._leases if now < g.ends]
        return done

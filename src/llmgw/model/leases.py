"""A lease of a key's allowance (API keys and limits): what the server grants a router and the router
spends. The rules are server/tenants/leases.py's (the book) and router/tenants/wallet.py's (the wallet)."""

from __future__ import annotations

from attrs import frozen


@frozen
class Grant:
    id: int
    router: str
    units: int
    granted_at: float
    ends: float  # granted_at + ttl: the router may use it until then
    # The leader's term that granted it ("" from a server before terms): grant ids are
    # unique within one term only, so a grant is named by (term, id) across a failover.
    term: str = ""

    def occupies_until(self, window: float) -> float:
        return self.ends + window

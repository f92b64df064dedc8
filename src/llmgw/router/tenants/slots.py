"""A router's slots of one key's concurrency (API keys and limits), pure: the slot grants it holds
and the requests it runs on them (server/tenants/slots.py says why the sum over routers
stays within the key's concurrency).

A request starts on a slot when the router runs fewer requests than the live slots it
holds: no round trip. A grant is live until `ends`, counted from the sending of the ask
or renewal that the server answered. Once a second (`renewals`) the router keeps what it
used at most in that second (the peak of its running requests) and gives back the rest:
a busy router keeps its slots, an idle one holds none within a second or two. The slots
it keeps of a grant are lowered here before the renewal is sent, so the server never
counts fewer than the router uses.
"""

from __future__ import annotations

import math

from attrs import define


@define(eq=False)  # compared by identity: two grants may look alike
class SlotLease:
    term: str
    id: int  # 0: the server has no such limit (any more): not renewed, lapses at its end
    slots: int
    ends: float


class SlotWallet:
    def __init__(self) -> None:
        self.leases: list[SlotLease] = []
        self.running = 0  # requests of the key running on this router (on slots or not)
        self.peak = 0  # most running since the last renewals
        # The live slots and the earliest end among the leases, kept so that a request's
        # start is a comparison (it runs on every request of a key with a concurrency).
        self._held = 0
        self._lapse = math.inf

    def _recount(self) -> None:
        self._held = sum(s.slots for s in self.leases)
        self._lapse = min((s.ends for s in self.leases), default=math.inf)

    def held(self, now: float) -> int:
        """Live slots at `now` (lapsed grants are dropped)."""
        if now >= self._lapse:
            self.leases = [s for s in self.leases if s.ends > now]
            self._recount()
        return self._held

    def start(self, now: float) -> bool:
        """A request starts on a slot, or takes nothing and answers False."""
        if self.running >= self.held(now):
            return False
        self.started()
        return True

    def started(self) -> None:
        """A request starts (without a slot too: on_server_loss's admission)."""
        self.running += 1
        self.peak = max(self.peak, self.running)

    def ended(self) -> None:
        self.running = max(0, self.running - 1)

    def add(self, lease: SlotLease) -> None:
        self.leases.append(lease)
        self._recount()

    def renewals(self, now: float) -> list[tuple[SlotLease, int]]:
        """(lease, slots kept of it) for every live lease the server knows, once the
        slots beyond the peak since the last call are given back (newest grants first):
        applied here before they are sent. Leases kept at 0 are dropped."""
        keep = max(self.peak, self.running)
        self.peak = self.running
        out: list[tuple[SlotLease, int]] = []
        total = self.held(now)
        for s in reversed(self.leases):
            cut = min(s.slots, max(0, total - keep))
            total -= cut
            s.slots -= cut
            if s.id:
                out.append((s, s.slots))
        self.leases = [s for s in self.leases if s.slots > 0]
        self._recount()
        out.reverse()
        return out

    def renewed(self, lease: SlotLease, kept: int, sent: float, ttl: float) -> None:
        """The server's answer to a renewal sent at `sent`: it counts `kept` slots of the
        lease (0: it has none of it), live for `ttl` from its arrival there."""
        if not any(s is lease for s in self.leases):
            return
        if kept <= 0:
            self.leases.remove(lease)
        else:
            lease.slots = min(lease.slots, kept)
            lease.ends = max(lease.ends, sent + ttl)
        self._recount()

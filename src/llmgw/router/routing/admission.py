"""Admission: a bounded first-come, first-served queue of requests per model.

A model has `capacity` slots (its ready replicas × `max_requests_per_replica`); a request
takes one for as long as it is being served. With every slot taken, a request waits in
the model's queue, at most `queue_size` of them and each at most `queue_wait`; one that
finds the queue full, or waits too long, is refused at once with 503 `server_overloaded`
and `Retry-After`: the router says it is overloaded rather than open one more engine
connection in a burst (and blame the engine when the connect comes too late).

Slots are handed to waiters in the order they came (trio's ParkingLot is FIFO); a new
request never passes one that waits. The fast path (a free slot, nobody waiting) is two
comparisons and an increment: no await, no scheduler round.
"""

from __future__ import annotations

import trio
from trio.lowlevel import ParkingLot


class Refused(Exception):
    """The request is not admitted; `why` says whether the queue was full or too slow."""

    def __init__(self, why: str, detail: str) -> None:
        super().__init__(detail)
        self.why = why  # "queue_full" or "queue_timeout", the metrics label


class Gate:
    __slots__ = ("active", "lot", "size", "wait", "refused")

    def __init__(self, size: int, wait: float) -> None:
        self.active = 0  # slots held
        self.lot = ParkingLot()  # requests waiting for one, oldest first
        self.size = size
        self.wait = wait
        self.refused = 0

    @property
    def queued(self) -> int:
        return len(self.lot)

    def try_enter(self, capacity: int) -> bool:
        """Take a slot now if one is free and nobody waits for it."""
        if self.active < capacity and not self.lot:
            self.active += 1
            return True
        return False

    async def enter(self, capacity: int, since: float) -> None:
        """Take a slot, waiting in line for one until `since + wait`. Raises Refused."""
        if self.try_enter(capacity):
            return
        if len(self.lot) >= self.size:
            self.refused += 1
            raise Refused("queue_full", f"{self.active} requests in flight and {len(self.lot)} queued")
        with trio.move_on_at(since + self.wait) as scope:
            await self.lot.park()  # `leave` or `pump` counted our slot before waking us
        if scope.cancelled_caught:
            self.refused += 1
            raise Refused("queue_timeout", f"no engine slot within {self.wait:g}s")

    def leave(self, capacity: int) -> None:
        self.active -= 1
        if self.lot:
            self.pump(capacity)

    def pump(self, capacity: int) -> None:
        """Hand free slots to the oldest waiters (after a leave, or more replicas)."""
        lot = self.lot
        while lot and self.active < capacity:
            self.active += 1
            lot.unpark()

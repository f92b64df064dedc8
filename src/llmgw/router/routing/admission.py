"""Admission: a bounded fair queue of requests per model, in priority classes.

A model has `capacity` slots (its ready replicas × `max_requests_per_replica`); a request
takes one for as long as it is being served. With every slot taken, a request waits in
the model's queue (routing/fairqueue.py): at most `size` of them; each in its class's
band, served highest band first and round-robin across API keys within a band, each for
at most its band's ttl. One that finds the queue full (with nothing of a lower band to
displace), waits too long, or is displaced by a request of a higher band is refused with
503 `server_overloaded` and `Retry-After`: the router says it is overloaded rather than
open one more engine connection in a burst (and blame the engine when the connect comes
too late).

With one band and one key this is first come, first served: a new request never passes
one that waits. The fast path (a free slot, nobody waiting) is two comparisons and an
increment: no await, no scheduler round. The queue is pure; this shell wakes waiters (a
slot freed: `leave`, more replicas: `pump`; a displacement: `enter` of the displacer),
and each waiter's own deadline is its timer, so the gate needs no task of its own.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import trio

from llmgw.router.routing.classes import DEFAULT
from llmgw.router.routing.fairqueue import SERVED, WAITING, Band, Entry, FairQueue, Shed


class Refused(Exception):
    """The request is not admitted; `why` says whether the queue was full or too slow."""

    def __init__(self, why: str, detail: str, band: str = DEFAULT) -> None:
        super().__init__(detail)
        self.why = why  # "queue_full", "queue_timeout" or "displaced": the metrics label
        self.band = band


class _Waiter:
    __slots__ = ("event", "shed", "queued_at")

    def __init__(self, queued_at: float) -> None:
        self.event = trio.Event()
        self.shed: Shed | None = None
        self.queued_at = queued_at  # when it joined the queue (its wait, for metrics)


# FairQueue wants a ttl above zero; a class that may not wait at all (queue_wait = 0, as
# it could be before classes) is refused before it is pushed, so its ttl there is moot.
_NO_WAIT = 1e-9


class Gate:
    __slots__ = ("active", "queue", "bands", "default", "refused", "_capacity", "_queued_band")

    def __init__(self, size: int, wait: float = 0.0, bands: Iterable[Band] = (),
                 default: str = "") -> None:
        """`bands`: the model's classes (none: one, DEFAULT, waiting `wait`); `default`:
        the band of `enter` without one (""): the highest."""
        given = tuple(bands) or (Band(DEFAULT, 0, wait),)
        self.queue: FairQueue[_Waiter] = FairQueue(
            (attrs.evolve(b, ttl=b.ttl or _NO_WAIT) for b in given), size)
        # The caller's band objects by name (their own ttl), and the queue's by name.
        self.bands = {b.name: b for b in given}
        self._queued_band = {b.name: b for b in self.queue.bands}
        self.default = self.bands[default or self.queue.bands[0].name]
        self.active = 0  # slots held
        self.refused = 0
        self._capacity = 0  # the last capacity the caller told: a cancelled waiter's slot

    @property
    def size(self) -> int:
        return self.queue.size

    @property
    def queued(self) -> int:
        return len(self.queue)

    def waiting(self, band: str) -> int:
        return self.queue.waiting(band)

    def try_enter(self, capacity: int) -> bool:
        """Take a slot now if one is free and nobody waits for it."""
        if self.active < capacity and not self.queue:
            self.active += 1
            return True
        return False

    async def enter(self, capacity: int, since: float, band: Band | None = None,
                    key: str = "") -> float:
        """Take a slot, waiting in `band` (the default: None) as `key` until `since` plus
        the band's ttl. Returns how long it queued. Raises Refused."""
        self._capacity = capacity
        if self.try_enter(capacity):
            return 0.0
        b = self.default if band is None else band
        now = trio.current_time()
        self._shed(now)
        queue = self.queue
        if since + b.ttl <= now:  # no time left to wait (a class that never waits)
            self.refused += 1
            if len(queue) >= queue.size:
                raise Refused("queue_full", f"{self.active} requests in flight and "
                              f"{len(queue)} queued", b.name)
            raise Refused("queue_timeout", f"no engine slot within {b.ttl:g}s", b.name)
        w = _Waiter(now)
        got = queue.push(w, self._queued_band[b.name], key, since)
        if isinstance(got, Shed):
            self.refused += 1
            raise Refused(got.why, f"{self.active} requests in flight and {got.detail}", b.name)
        self._shed(now)  # whom it displaced
        try:
            with trio.move_on_at(since + b.ttl):
                await w.event.wait()  # `pump` counted our slot, or `_shed` chose us
        except BaseException:
            self._abandon(got)
            raise
        return self._outcome(got, w, trio.current_time())

    def _outcome(self, e: Entry[_Waiter], w: _Waiter, now: float) -> float:
        if e.state == SERVED:  # a slot was counted for us, whether or not the timer fired too
            return now - w.queued_at
        if e.state == WAITING:  # our own deadline
            self.queue.cancel(e)
            shed = Shed("queue_timeout", f"no engine slot within {self.bands[e.band.name].ttl:g}s",
                        e.band.name)
        else:
            shed = w.shed or Shed("queue_timeout", "shed", e.band.name)
        self.refused += 1
        raise Refused(shed.why, shed.detail, shed.band)

    def _abandon(self, e: Entry[_Waiter]) -> None:
        """The waiter's handler is cancelled (its client went): out of the queue, or the
        slot already counted for it back to the next waiter."""
        if e.state == SERVED:
            self.leave(self._capacity)
        else:
            self.queue.cancel(e)

    def _shed(self, now: float) -> None:
        for e, why in self.queue.expire(now):
            e.item.shed = why
            e.item.event.set()

    def leave(self, capacity: int) -> None:
        self.active -= 1
        if self.queue:
            self.pump(capacity)

    def pump(self, capacity: int) -> None:
        """Hand free slots to the waiters next in turn (after a leave, or more replicas)."""
        self._capacity = capacity
        queue = self.queue
        if not queue:
            return
        self._shed(trio.current_time())
        while self.active < capacity:
            e = queue.pop()
            if e is None:
                break
            self.active += 1
            e.item.event.set()

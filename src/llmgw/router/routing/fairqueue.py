"""The fair queue (pure): a model's waiting requests in priority bands, fair across keys.

A model's queue holds what waits for an engine slot (the slots themselves stay with the
caller, as `admission.Gate.active` does). Each waiting request has a band (its priority
class), a key (the tenant: the API key's name) and the time it came (`since`). Order:

- the highest band with a waiting request first (a lower band is never served while a
  higher one has a request waiting);
- within a band, round-robin across keys, each key's own requests first come, first
  served: a key served goes to the back of the band's ring, so one key's burst waits its
  turn behind every other key's single request. Exactly: between two services of a key in
  a band, every other key of that band that waited throughout is served at least once;
- each band has a time-to-live: a request still waiting at `since + ttl` is shed
  (returned by `expire(now)`, reason `queue_timeout`, for a 503 with Retry-After);
- at most `size` wait in all; a request that finds the queue full displaces the newest
  request of the key with the most waiting in the lowest band below its own (reason
  `displaced`), or, with no lower band waiting, is refused (reason `queue_full`);
- `cancel` takes out a request whose client is gone.

Every request pushed comes back exactly once: refused at `push`, served by `pop`, shed by
`expire` (timed out or displaced) or taken back by `cancel`. With one band and one key it
is first come, first served, as admission's queue is today. Time is passed in; nothing
here awaits or reads a clock: the caller calls `expire(now)` before `pop`, and wakes at
`next_deadline()`.

A request may lower its own class, never raise it: `effective_band(key_class, asked)`.

vLLM (0.32, read in its own code) and the band a request goes on with:
- `vllm serve --scheduling-policy {fcfs,priority}` (engine/arg_utils.py:1744-1745, the
  choices `SchedulerPolicy = Literal["fcfs", "priority"]`, config/scheduler.py:21, default
  "fcfs" at :159): a deployment's args, which the real-engine tier parses with vLLM's own
  parser (tests/real_engine/test_vllm_args.py, with the request models and the queue order
  below).
- The request's `priority` is an `int`, default 0, bounded to int64, on both
  CompletionRequest (entrypoints/openai/completion/protocol.py:136) and
  ChatCompletionRequest (entrypoints/openai/chat_completion/protocol.py:388); pydantic
  takes a numeric string ("2") and refuses a word, a float or 2**63 (a 400). An
  `X-Vllm-Priority` header, when it parses as an int, overrides the body's field
  (entrypoints/generate/base/serving.py:42 and :258-269).
- LOWER value is served EARLIER: with the priority policy the waiting queue is a heap
  (v1/core/sched/request_queue.py:131-151) ordered by `Request.__lt__`: priority, then
  arrival time, then request id (v1/request.py:357-367); when KV blocks run out the
  running request with the largest (priority, arrival_time) is preempted
  (v1/core/sched/scheduler.py:796-800). Under "fcfs" the field is carried and ignored
  (FCFSRequestQueue, v1/core/sched/request_queue.py:75). The field's description
  says a non-zero priority is an error without the priority policy, but no code in 0.32
  raises it: nothing outside engine/arg_utils.py and v1/core/sched/ reads the policy.
- So `vllm_priority` maps the highest band to 0 (vLLM's default) and each lower band to
  one more (1, 2, ...): the same order on the engine as in this queue. The router writes
  the field itself: a client's own `priority` in the body must be overwritten (or it
  could raise itself on the engine); the router sends engines no client headers
  (connection/relay.py builds the request head), so X-Vllm-Priority cannot pass.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

import attrs

T = TypeVar("T")

WAITING, SERVED, SHED, CANCELLED = "waiting", "served", "shed", "cancelled"


@attrs.frozen
class Band:
    """A priority class of a model: a higher `rank` is served first; a request waits at
    most `ttl` seconds in it."""

    name: str
    rank: int
    ttl: float


@attrs.frozen
class Shed:
    """Why a request is not served: `why` is the metrics label (`queue_full`,
    `queue_timeout` or `displaced`), `detail` the operator's words."""

    why: str
    detail: str
    band: str


def effective_band(key_class: Band, asked: Band | None) -> Band:
    """The band a request waits in: the one it asked for if no higher than its key's."""
    return key_class if asked is None or asked.rank > key_class.rank else asked


class Entry(Generic[T]):
    """One waiting request: the caller keeps it to cancel it."""

    __slots__ = ("item", "band", "key", "since", "deadline", "seq", "state")

    def __init__(self, item: T, band: Band, key: str, since: float, seq: int) -> None:
        self.item = item
        self.band = band
        self.key = key
        self.since = since
        self.deadline = since + band.ttl
        self.seq = seq
        self.state = WAITING

    def __lt__(self, other: Entry[T]) -> bool:  # the deadline heap's order
        return (self.deadline, self.seq) < (other.deadline, other.seq)


class _Ring(Generic[T]):
    """One band: each key's FIFO, and the keys with a request waiting in serving order."""

    __slots__ = ("keys", "queues", "count")

    def __init__(self) -> None:
        self.keys: deque[str] = deque()
        self.queues: dict[str, deque[Entry[T]]] = {}
        self.count = 0

    def push(self, e: Entry[T]) -> None:
        q = self.queues.get(e.key)
        if q is None:
            q = self.queues[e.key] = deque()
            self.keys.append(e.key)  # a key that starts waiting joins at the back
        q.append(e)
        self.count += 1

    def pop(self) -> Entry[T]:
        key = self.keys.popleft()
        q = self.queues[key]
        e = q.popleft()
        if q:
            self.keys.append(key)  # served: to the back of the ring
        else:
            del self.queues[key]
        self.count -= 1
        return e

    def remove(self, e: Entry[T]) -> None:
        q = self.queues[e.key]
        q.remove(e)
        if not q:
            del self.queues[e.key]
            self.keys.remove(e.key)
        self.count -= 1

    def newest_of_longest(self) -> Entry[T]:
        return max(self.queues.values(), key=len)[-1]


class FairQueue(Generic[T]):
    """The waiting requests of one model. `bands`: its classes; `size`: how many may wait."""

    def __init__(self, bands: Iterable[Band], size: int) -> None:
        self.bands = tuple(sorted(bands, key=lambda b: -b.rank))
        names = {b.name for b in self.bands}
        if not self.bands or len(names) != len(self.bands):
            raise ValueError("bands need distinct names, at least one")
        if len({b.rank for b in self.bands}) != len(self.bands):
            raise ValueError("bands need distinct ranks")
        if any(not b.ttl > 0 for b in self.bands):
            raise ValueError("a band's ttl must be above zero")
        if size < 0:
            raise ValueError("size must be zero or more")
        self.size = size
        self._rings: dict[str, _Ring[T]] = {b.name: _Ring() for b in self.bands}
        self._deadlines: list[Entry[T]] = []  # a heap; entries no longer waiting linger
        self._shed: list[tuple[Entry[T], Shed]] = []  # displaced, until `expire` hands them out
        self._seq = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def band(self, name: str) -> Band | None:
        for b in self.bands:
            if b.name == name:
                return b
        return None

    def waiting(self, band: str) -> int:
        return self._rings[band].count

    def keys(self, band: str) -> Iterator[str]:
        """The band's keys with a request waiting, in the order they will be served."""
        return iter(self._rings[band].keys)

    def push(self, item: T, band: Band, key: str, since: float) -> Entry[T] | Shed:
        """Wait in `band` as `key` from `since`; a Shed if the queue is full."""
        if self._rings.get(band.name) is None or self.band(band.name) != band:
            raise ValueError(f"band {band.name!r} is not one of this queue's")
        if self._count >= self.size:
            victim = self._victim(band)
            if victim is None:
                return Shed("queue_full", f"{self._count} requests queued", band.name)
            self._take(victim, SHED)
            self._shed.append((victim, Shed(
                "displaced", f"queue full: displaced by a request of class {band.name}",
                victim.band.name)))
        self._seq += 1
        e = Entry(item, band, key, since, self._seq)
        self._rings[band.name].push(e)
        heapq.heappush(self._deadlines, e)
        self._count += 1
        return e

    def pop(self) -> Entry[T] | None:
        """The next request to serve (call `expire(now)` first), or None."""
        for b in self.bands:
            ring = self._rings[b.name]
            if ring.count:
                e = ring.pop()
                e.state = SERVED
                self._count -= 1
                self._compact()
                return e
        return None

    def cancel(self, e: Entry[T]) -> bool:
        """Take out a request whose client is gone; False if it no longer waits."""
        if e.state != WAITING:
            return False
        self._take(e, CANCELLED)
        self._compact()
        return True

    def expire(self, now: float) -> list[tuple[Entry[T], Shed]]:
        """Shed every request whose band's ttl has run out by `now`, with those displaced
        since the last call, oldest deadline first."""
        out, self._shed = self._shed, []
        heap = self._deadlines
        while heap and heap[0].deadline <= now:
            e = heapq.heappop(heap)
            if e.state == WAITING:
                self._take(e, SHED)
                out.append((e, Shed("queue_timeout", f"no engine slot within {e.band.ttl:g}s",
                                    e.band.name)))
        return out

    def next_deadline(self) -> float | None:
        """When `expire` next has something to shed (now, if a request was displaced)."""
        if self._shed:
            return float("-inf")
        heap = self._deadlines
        while heap and heap[0].state != WAITING:
            heapq.heappop(heap)
        return heap[0].deadline if heap else None

    def vllm_priority(self, band: Band) -> int:
        """vLLM's `priority` for a request of `band`: 0 for the highest band, one more for
        each band below (vLLM serves lower values first)."""
        return self.bands.index(band)

    def _victim(self, band: Band) -> Entry[T] | None:
        for b in reversed(self.bands):
            if b.rank >= band.rank:
                return None
            ring = self._rings[b.name]
            if ring.count:
                return ring.newest_of_longest()
        return None

    def _take(self, e: Entry[T], state: str) -> None:
        self._rings[e.band.name].remove(e)
        e.state = state
        self._count -= 1

    def _compact(self) -> None:
        # Served and cancelled entries stay in the heap until their deadline: rebuild it
        # when they outnumber the waiting, so it stays bounded by the queue's size.
        if len(self._deadlines) > 2 * self._count + 64:
            self._deadlines = [e for e in self._deadlines if e.state == WAITING]
            heapq.heapify(self._deadlines)

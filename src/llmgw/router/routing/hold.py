"""Holding requests for a model scaled to zero until its first replica is ready.

The endpoint table lists such a model as `cold`: routable though nothing of it is ready.
Its requests wait here, at most `size` per model and each at most `budget` from when it
came; the router polls the table often while any waits and releases them all the moment
a replica is ready (or the model is no longer cold: deleted, pinned). The caller tells
the server at once when a model's first request is held (a wake).
"""

from __future__ import annotations

import trio


class HoldRefused(Exception):
    """Not held, or held too long; `why` is the metrics label."""

    def __init__(self, why: str, detail: str) -> None:
        super().__init__(detail)
        self.why = why  # "hold_full" or "cold_start_timeout"


class _Queue:
    __slots__ = ("count", "ready")

    def __init__(self) -> None:
        self.count = 0
        self.ready = trio.Event()


class Holds:
    def __init__(self, size: int, budget: float) -> None:
        self.size = size
        self.budget = budget
        self.queues: dict[str, _Queue] = {}

    def held(self, model: str) -> int:
        q = self.queues.get(model)
        return q.count if q is not None else 0

    @property
    def any(self) -> bool:
        return bool(self.queues)

    async def hold(self, model: str, since: float) -> None:
        """Wait until `release(model)`, at most until `since + budget`. Raises HoldRefused."""
        q = self.queues.get(model)
        if q is None:
            q = self.queues[model] = _Queue()
        if q.count >= self.size:
            raise HoldRefused("hold_full", f"{q.count} requests already wait for its first replica")
        q.count += 1
        ready = q.ready
        try:
            with trio.move_on_at(since + self.budget) as scope:
                await ready.wait()
        finally:
            q.count -= 1
            if not q.count and self.queues.get(model) is q:
                del self.queues[model]
        if scope.cancelled_caught:
            raise HoldRefused("cold_start_timeout",
                              f"no replica ready within the cold-start budget ({self.budget:g}s)")

    def release(self, model: str) -> int:
        """Wake every request held for `model`; returns how many."""
        q = self.queues.pop(model, None)
        if q is None:
            return 0
        q.ready.set()
        return q.count

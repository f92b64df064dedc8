"""Choosing a replica by what it holds and how loaded it is.

score(r) = w * uncached_prefill_blocks(r) + load(r), lowest wins, where
uncached_prefill_blocks is the request's full blocks minus the run the index matched on r,
and load is what the least-outstanding policy compares (router/routing/balancer.py,
`Replica.score`): the router's in-flight count plus the engine's waiting queue (plus its
full-KV penalty) while the engine's figures are fresh, the in-flight count alone when
they are stale. `w` says how many queued requests one block of prefill is worth.

Ties go to the lower load, then the smaller replica id, so the choice is reproducible.
"""

from __future__ import annotations

from collections.abc import Mapping


def scores(
    matched: Mapping[str, int], total_blocks: int, loads: Mapping[str, float], w: float
) -> dict[str, float]:
    """Each candidate's score (the candidates are the keys of `loads`)."""
    total = max(total_blocks, 0)
    out: dict[str, float] = {}
    for r, load in loads.items():
        hit = min(max(matched.get(r, 0), 0), total)
        out[r] = w * (total - hit) + load
    return out


def choose(
    matched: Mapping[str, int], total_blocks: int, loads: Mapping[str, float], w: float
) -> str | None:
    """The candidate with the lowest score, or None when there is none."""
    s = scores(matched, total_blocks, loads, w)
    if not s:
        return None
    return min(s, key=lambda r: (s[r], loads[r], r))

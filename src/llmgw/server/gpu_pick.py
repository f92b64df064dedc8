"""Choosing a tensor-parallel group of GPUs within one node (pure).

An NVLink clique when the free GPUs hold one; otherwise the GPUs closest to each other:
one NUMA node if it can, then neighbouring PCI bus ids.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmgw.model.inventory import Gpu


def _bus(g: Gpu) -> int:
    """PCI domain and bus as one number ("00000000:18:00.0" -> 0x18); 0 when unreadable."""
    parts = g.pci_bus_id.split(":")
    try:
        if len(parts) >= 3:
            return int(parts[0], 16) * 256 + int(parts[1], 16)
        if len(parts) == 2:
            return int(parts[0], 16)
    except ValueError:
        return 0  # unreadable: ranks as "far" from everything, never an error
    return 0


def _locality(g: Gpu) -> tuple[int, int, int]:
    return (g.numa_node if g.numa_node is not None else -1, _bus(g), g.index)


def pick_gpus(free: Sequence[Gpu], k: int) -> tuple[tuple[str, ...], bool] | None:
    """k GPUs out of `free`, and whether they form an NVLink clique. None: fewer than k.

    A single GPU counts as a clique (every node fits a TP=1 group equally well).
    """
    if len(free) < k or k <= 0:
        return None
    ordered = sorted(free, key=_locality)
    if k == 1:
        return (ordered[0].uuid,), True
    clique = _clique(ordered, k)
    if clique is not None:
        return tuple(g.uuid for g in clique), True
    return tuple(g.uuid for g in _closest(ordered, k)), False


def _clique(ordered: list[Gpu], k: int) -> list[Gpu] | None:
    uuids = {g.uuid for g in ordered}
    adj = {
        g.uuid: {p for p, links in g.nvlink_peers.items() if links > 0 and p in uuids}
        for g in ordered
    }
    # Links as either side reports them.
    for g in ordered:
        for p in adj[g.uuid]:
            adj[p].add(g.uuid)
    cands = [g for g in ordered if len(adj[g.uuid]) >= k - 1]
    if len(cands) < k:
        return None
    chosen: list[Gpu] = []

    def extend(start: int) -> bool:
        if len(chosen) == k:
            return True
        for i in range(start, len(cands)):
            if len(cands) - i < k - len(chosen):
                return False
            g = cands[i]
            if all(c.uuid in adj[g.uuid] for c in chosen):
                chosen.append(g)
                if extend(i + 1):
                    return True
                chosen.pop()
        return False

    return chosen if extend(0) else None


def _closest(ordered: list[Gpu], k: int) -> list[Gpu]:
    """A window of k GPUs in locality order with the fewest NUMA nodes, then bus span."""
    best: tuple[int, int] | None = None
    best_at = 0
    for i in range(len(ordered) - k + 1):
        window = ordered[i : i + k]
        numas = len({g.numa_node for g in window})
        span = _bus(window[-1]) - _bus(window[0])
        key = (numas, span)
        if best is None or key < best:
            best, best_at = key, i
    return ordered[best_at : best_at + k]

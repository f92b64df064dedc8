"""Choosing a tensor-parallel group of GPUs within one node (pure).

An NVLink clique when the free GPUs hold one. Otherwise, where the node reported each
GPU's PCIe ancestry (Gpu.pci_path), the group whose farthest pair is nearest, in the
order of `nvidia-smi topo -m`: all under one PCIe switch (PIX), under one bridge below
the host bridge (PXB), under one host bridge (PHB), on one NUMA node (NODE). Where it did
not (older agents, unreadable sysfs), as before: one NUMA node if it can, then
neighbouring PCI bus ids, which say nothing about switches.

The tiers are read off the paths here rather than from the agent's pcie.link_kind (the
server never imports the agent); a unit test checks the two agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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
        one = pcie_group(ordered, 1)
        return ((one[0] if one else ordered[0]).uuid,), True
    clique = _clique(ordered, k)
    if clique is not None:
        return tuple(g.uuid for g in clique), True
    group = pcie_group(ordered, k)
    if group is not None:
        return tuple(g.uuid for g in group), False
    return tuple(g.uuid for g in _closest(ordered, k)), False


# Tiers by the length of the prefix every member shares in (NUMA node,) + pci_path:
# 3 or more: one bridge below the host bridge (PIX where each hangs at most two levels
# below it, PXB otherwise); 2: one host bridge (PHB); 1: one NUMA node (NODE).
PIX, PXB, PHB, NODE, SYS = "PIX", "PXB", "PHB", "NODE", "SYS"


def _ext(g: Gpu) -> tuple[object, ...]:
    return (g.numa_node, *g.pci_path)


def pcie_group(ordered: Sequence[Gpu], k: int) -> list[Gpu] | None:
    """k GPUs of `ordered` (locality order) in the nearest PCIe tier, or None when fewer
    than k of them have a pci_path, or when the paths are partly missing and no tier up
    to NODE holds k (the bus-distance fallback decides then, as it always did).

    In the nearest tier, the smallest set that holds k is taken (best fit: a pair goes to
    the switch with two free GPUs, leaving the one with four whole), ties to the set whose
    first GPU comes first; within it `_pack` keeps sub-branches whole.
    """
    known = [g for g in ordered if g.pci_path]
    if len(known) < k:
        return None
    ext = {g.uuid: _ext(g) for g in known}
    for tier in (PIX, PXB, PHB, NODE):
        sets = [m for m in _tier_sets(known, ext, tier) if len(m) >= k]
        if sets and k == 1:
            # The GPU whose largest PIX set is smallest: the same best fit, without
            # comparing every set with every other (placement asks this per node).
            most: dict[str, int] = {}
            for m in sets:
                for g in m:
                    most[g.uuid] = max(most.get(g.uuid, 0), len(m))
            return [min(known, key=lambda g: most[g.uuid])]
        if sets:
            best = min(_largest(sets) if tier == PIX else sets, key=len)
            return _pack(best, k, _shared(best, ext), ext)
    if len(known) < len(ordered):
        return None
    return _pack(known, k, 0, ext)  # across NUMA nodes (SYS): still keep branches whole


def _tier_sets(
    known: list[Gpu], ext: dict[str, tuple[object, ...]], tier: str
) -> Iterable[list[Gpu]]:
    """Sets of GPUs all of whose pairs are at `tier` or nearer, one per prefix, in the
    order of their first GPU (and of locality within each). For PXB only the largest:
    those below a root port, which hold every set of a bridge below it."""
    sets: dict[tuple[object, ...], list[Gpu]] = {}
    for g in known:
        e = ext[g.uuid]
        if tier == PIX:
            # A PIX pair's lowest common ancestor is a bridge 1 or 2 levels above each.
            lengths: tuple[int, ...] = tuple(n for n in (len(e) - 1, len(e) - 2) if n >= 3)
        elif tier == PXB:
            lengths = (3,) if len(e) > 3 else ()
        elif tier == PHB:
            lengths = (2,)
        else:
            lengths = (1,) if e[0] is not None else ()  # an unknown node is no node
        for n in lengths:
            sets.setdefault(e[:n], []).append(g)
    return sets.values()


def _largest(sets: list[list[Gpu]]) -> list[list[Gpu]]:
    """Drop the sets inside another: a GPU alone under its downstream port is a PIX set
    too, and best fit must compare switches, not ports (nested ones are _pack's)."""
    if len(sets) == 1:
        return sets
    keys = [frozenset(g.uuid for g in m) for m in sets]
    return [m for m, key in zip(sets, keys, strict=True) if not any(key < o for o in keys)]


def _shared(members: list[Gpu], ext: dict[str, tuple[object, ...]]) -> int:
    first = ext[members[0].uuid]
    n = len(first)
    for g in members[1:]:
        e = ext[g.uuid]
        i = 0
        while i < n and i < len(e) and e[i] == first[i]:
            i += 1
        n = i
    return n


def _pack(
    members: list[Gpu], k: int, level: int, ext: dict[str, tuple[object, ...]]
) -> list[Gpu]:
    """k of `members` (all sharing ext[:level]), staying inside as few branches below
    that level as it can: the smallest branch that holds k; else whole branches, largest
    first, and the rest from the smallest branch that holds it, packed the same way."""
    if len(members) <= k:
        return members[:k]
    branches: dict[object, list[Gpu]] = {}
    for g in members:
        e = ext[g.uuid]
        branches.setdefault(e[level] if level < len(e) else ("leaf", g.uuid), []).append(g)
    if len(branches) == 1:
        return _pack(members, k, level + 1, ext)
    groups = list(branches.values())
    fits = [b for b in groups if len(b) >= k]
    if fits:
        return _pack(min(fits, key=len), k, level + 1, ext)
    chosen: list[Gpu] = []
    left = k
    rest: list[list[Gpu]] = []
    for b in sorted(groups, key=len, reverse=True):
        if len(b) <= left:
            chosen += b
            left -= len(b)
        else:
            rest.append(b)
    if left:
        chosen += _pack(min(rest, key=len), left, level + 1, ext)
    return chosen


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

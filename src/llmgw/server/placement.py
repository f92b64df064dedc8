"""Placement: where one replica goes, as a pure function over an inventory snapshot.

Filters: the node is ready and neither cordoned nor draining; it can start the
deployment's engine kind (an inventory that does not say counts as able); its labels
match the selector; it has enough free GPUs of at least `gpu_memory_min`; for a gang
(`nodes > 1`) every member shares one fabric that is not down on any of them and has the
same GPU model. Islands (no fabrics) never hold a multi-node replica.

Preference, never a filter, in this order: holding complete weights for the model (for
a gang, the more members that hold them the better); then NVLink fit of the
tensor-parallel group; then the strategy (pack: fewest free GPUs, spread: most).

Speed: a ClusterView (cluster_view.py) indexes the nodes (free-GPU buckets per fabric and
GPU model, an inverted index of who holds which model) so that one placement looks at a
handful of nodes, not all of them. It is a plain value owned by its caller, kept across
passes by the reconcile state and updated by deltas.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from attrs import field, frozen

from llmgw.model.deployment import RAY_PORT_BLOCK, Deployment, Member, Strategy
from llmgw.model.engine import EngineKind

from .cluster_view import ClusterView, NodeView, _Group, _Node
from .gpu_pick import pick_gpus

__all__ = ["ClusterView", "NodeView", "Placement", "Unschedulable", "explain", "place"]

_SCAN_HOLDERS_DIRECTLY = 256  # above this many holders, scan buckets instead


@frozen
class Placement:
    members: tuple[Member, ...]
    fabric: str = ""
    holders: int = 0  # members that hold complete weights
    nvlink: int = 0  # members whose GPUs form an NVLink clique


@frozen
class Unschedulable:
    reason: str
    counts: dict[str, int] = field(factory=dict)


# ---------------------------------------------------------------- choosing


def _ports_needed(d: Deployment, head: bool) -> int:
    count = 1
    if d.nodes > 1:
        count += 1 if head else 0
        if d.engine == EngineKind.VLLM:
            count += RAY_PORT_BLOCK + (1 if head else 0)
    return count


def _fit(n: _Node, d: Deployment) -> tuple[tuple[str, ...], bool] | None:
    """The GPUs this node would give, and whether they are an NVLink clique; None: no fit."""
    need = d.gpus_per_node
    if len(n.free) < need or d.engine in n.lacked:
        return None
    for k, v in d.selector.items():
        if n.labels.get(k) != v:
            return None
    key = (need, d.gpu_memory_min)
    if key in n.cache:
        return n.cache[key]
    result: tuple[tuple[str, ...], bool] | None = None
    if (n.hi - n.lo + 1) - len(n.ports) >= _ports_needed(d, True):
        free = [n.gpus[u] for u in n.free if n.gpus[u].memory_total >= d.gpu_memory_min]
        if len(free) >= need:
            result = pick_gpus(free, need)
    n.cache[key] = result
    return result


@frozen
class _Choice:
    node: _Node
    gpus: tuple[str, ...]
    holds: bool
    nvlink: bool

    def strat(self, strategy: Strategy) -> int:
        left = len(self.node.free) - len(self.gpus)
        return -left if strategy == Strategy.PACK else left


def _pick(
    view: ClusterView, group: _Group, d: Deployment, exclude: frozenset[str]
) -> list[_Choice] | None:
    """The best `d.nodes` nodes of one group, best first; None when too few fit."""
    k = d.nodes
    holders = view.holders.get(d.model, set())
    chosen: list[_Choice] = []
    if holders:
        if len(holders) <= _SCAN_HOLDERS_DIRECTLY:
            for nid in sorted(holders):
                n = view.nodes[nid]
                if nid in group.ids and nid not in exclude:
                    r = _fit(n, d)
                    if r is not None:
                        chosen.append(_Choice(n, r[0], True, r[1]))
            chosen.sort(key=lambda c: (not c.nvlink, -c.strat(d.strategy)))
            chosen = chosen[:k]
        else:
            chosen = _scan(group, d, k, exclude, lambda nid: nid in holders, True)
    if len(chosen) < k:
        taken = exclude | {c.node.id for c in chosen}
        chosen += _scan(group, d, k - len(chosen), taken, lambda nid: nid not in holders, False)
    return chosen if len(chosen) == k else None


def _scan(
    group: _Group, d: Deployment, want: int, exclude: frozenset[str], ok: object, holds: bool
) -> list[_Choice]:
    """Up to `want` fitting nodes in strategy order, NVLink fits first; stops early."""
    good: list[_Choice] = []
    fallback: list[_Choice] = []
    for n in group.scan(d.gpus_per_node, d.strategy):
        if n.id in exclude or not ok(n.id):  # type: ignore[operator]
            continue
        r = _fit(n, d)
        if r is None:
            continue
        c = _Choice(n, r[0], holds, r[1])
        if c.nvlink:
            good.append(c)
            if len(good) >= want:
                break
        elif len(fallback) < want:
            fallback.append(c)
    return (good + fallback)[:want]


def _score(chosen: list[_Choice], strategy: Strategy) -> tuple[int, int, int]:
    return (
        sum(c.holds for c in chosen),
        sum(c.nvlink for c in chosen),
        sum(c.strat(strategy) for c in chosen),
    )


def place(
    deployment: Deployment,
    nodes: Mapping[str, NodeView] | ClusterView,
    *,
    exclude: frozenset[str] = frozenset(),
) -> Placement | Unschedulable:
    """Where one replica of `deployment` goes. Reserves nothing: call view.reserve()."""
    view = nodes if isinstance(nodes, ClusterView) else ClusterView(nodes)
    d = deployment
    if d.nodes == 1:
        groups = [("", view.all)]
    else:
        groups = [(key[0], g) for key, g in sorted(view.groups.items())]
    best: tuple[tuple[int, int, int], str, list[_Choice]] | None = None
    for fabric, group in groups:
        chosen = _pick(view, group, d, exclude)
        if chosen is None:
            continue
        score = _score(chosen, d.strategy)
        if best is None or score > best[0]:
            best = (score, fabric, chosen)
    if best is None:
        return explain(d, view, exclude)
    _, fabric, chosen = best
    chosen.sort(key=lambda c: (not c.holds, not c.nvlink, -c.strat(d.strategy)))
    members = _members(d, fabric, chosen)
    if members is None:  # a port range too fragmented for a Ray block: leave those out
        return place(d, view, exclude=exclude | {c.node.id for c in chosen})
    return Placement(
        members=members,
        fabric=fabric,
        holders=sum(c.holds for c in chosen),
        nvlink=sum(c.nvlink for c in chosen),
    )


def _members(d: Deployment, fabric: str, chosen: list[_Choice]) -> tuple[Member, ...] | None:
    gang = d.nodes > 1
    ray = gang and d.engine == EngineKind.VLLM
    head_ports: dict[str, int] = {}
    out: list[Member] = []
    for rank, c in enumerate(chosen):
        n = c.node
        taken = set(n.ports)
        port = _free_port(n, taken)
        if port is None:
            return None
        taken.add(port)
        if rank == 0 and gang:
            rdzv = _free_port(n, taken)
            if rdzv is None:
                return None
            taken.add(rdzv)
            head_ports["rdzv"] = rdzv
            if ray:
                gcs = _free_port(n, taken)
                if gcs is None:
                    return None
                taken.add(gcs)
                head_ports["ray"] = gcs
        base = 0
        if ray:
            found = _free_block(n, taken, RAY_PORT_BLOCK)
            if found is None:
                return None
            base = found
        out.append(
            Member(
                node_id=n.id,
                rank=rank,
                gpus=c.gpus,
                port=port,
                addr=n.addr,
                rendezvous_port=head_ports.get("rdzv", 0),
                ray_port=head_ports.get("ray", 0),
                ray_port_base=base,
                hcas=n.fabrics[fabric].hcas if gang else (),
            )
        )
    return tuple(out)


def _free_port(n: _Node, taken: set[int]) -> int | None:
    for p in range(n.lo, n.hi + 1):
        if p not in taken:
            return p
    return None


def _free_block(n: _Node, taken: set[int], size: int) -> int | None:
    start = n.lo
    while start + size - 1 <= n.hi:
        clash = [p for p in range(start, start + size) if p in taken]
        if not clash:
            return start
        start = clash[-1] + 1
    return None


# ---------------------------------------------------------------- explaining


def _reject(n: _Node, d: Deployment, exclude: frozenset[str]) -> str:
    if n.reject:
        return n.reject
    if n.id in exclude:
        return "were excluded"
    if any(n.labels.get(k) != v for k, v in d.selector.items()):
        return "lacked labels " + ",".join(f"{k}={v}" for k, v in sorted(d.selector.items()))
    if d.engine in n.lacked:
        return n.lacked[d.engine]
    mem = d.gpu_memory_min
    usable = [u for u in n.free if n.gpus[u].memory_total >= mem]
    if len(usable) < d.gpus_per_node:
        plural = "s" if d.gpus_per_node != 1 else ""
        what = f"{d.gpus_per_node} free GPU{plural}"
        return f"lacked {what} of {mem} MiB" if mem else f"lacked {what}"
    if (n.hi - n.lo + 1) - len(n.ports) < _ports_needed(d, True):
        return "lacked free ports"
    if d.nodes > 1:
        if not n.view.inventory.fabrics:
            return "lacked fabric"
        if not n.fabrics:
            return "had their fabric down"
    return ""


def explain(
    d: Deployment, view: ClusterView, exclude: frozenset[str] = frozenset()
) -> Unschedulable:
    """Why no node (or no fabric, for a gang) fits, aggregated over the nodes."""
    counts: Counter[str] = Counter()
    fit = 0
    by_group: Counter[tuple[str, str]] = Counter()
    for n in view.nodes.values():
        why = _reject(n, d, exclude)
        if why:
            counts[why] += 1
        else:
            fit += 1
            for fabric in n.fabrics:
                by_group[(fabric, n.gpu_name)] += 1
    total = len(view.nodes)
    parts = [f"{c} {why}" for why, c in sorted(counts.items(), key=lambda x: (-x[1], x[0]))]
    if d.nodes > 1:
        best = max(by_group.values(), default=0)
        head = f"0/{total} nodes fit a {d.nodes}-node replica"
        if fit:
            parts.insert(
                0,
                f"{fit} fit alone but no fabric has {d.nodes} of them with one GPU model "
                f"(at most {best})",
            )
    else:
        head = f"0/{total} nodes fit"
    if not total:
        parts = ["no nodes known"]
    return Unschedulable(reason=f"{head}: " + ", ".join(parts), counts=dict(counts))

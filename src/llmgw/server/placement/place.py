"""Placement: where one replica goes, as a pure function over an inventory snapshot.

Filters: the node is ready and neither cordoned nor draining; it can start the
deployment's engine kind (an inventory that does not say counts as able); its labels
match the selector; it has enough free GPUs; for a gang (`nodes > 1`) every member
shares one fabric that is not down on any of them and has the same GPU model. Islands
(no fabrics) never hold a multi-node replica.

A free GPU is one no replica of ours holds, placeable (no problem, hard or soft, and not releasing, as the
agent reports it) and with at least the engine's need in free memory:
`memory_need(engine, args, total, gpu_memory_min)` (vLLM's --gpu-memory-utilization x
total, SGLang's --mem-fraction-static, 0.9 by default, plus the engine's own CUDA context,
CONTEXT_RESERVE; gpu_memory_min a floor). vLLM refuses to start below that, so a GPU
other processes hold is no answer at all.

Space: a node that would download the model (it holds no complete copy) and reports less
free space in its download_dir than the model's size is no fit, where both are known: the
size from another node's complete copy, the free space from the agent's storage scan. The
bytes of that model already in its download_dir (a download under way or cut short, which
the next engine there shares or resumes) count as its room: a second replica on the node,
or a restart mid-download, needs only the rest free, and is not charged the whole size
again for what the first download already took.
Holding weights is never required (a download is a valid answer).
A gang's placement also names the path at which every member holds a complete copy, if
one does (gang_weights.py): its head may then start on a local copy.

Preference, never a filter, in this order: holding complete weights for the model (for
a gang, the more members that hold them the better); then NVLink fit of the
tensor-parallel group; then the strategy (pack: fewest free GPUs, spread: most).

When nothing fits, `explain` (explain.py) says why, node counts by reason and, for the
few nodes closest to fitting, what kept them out. One node's filters are in fit.py;
this module chooses among the nodes that pass them and gives the members their ports.

Speed: a ClusterView (cluster_view.py) indexes the nodes (free-GPU buckets per fabric and
GPU model, an inverted index of who holds which model) so that one placement looks at a
handful of nodes, not all of them. It is a plain value owned by its caller, kept across
passes by the reconcile state and updated by deltas.
"""

from __future__ import annotations

from collections.abc import Mapping

from attrs import frozen

from llmgw.model.deployment import (
    ENGINE_PORT_BLOCK,
    RAY_PORT_BLOCK,
    SGLANG_DIST_INIT,
    Deployment,
    Member,
    Strategy,
)
from llmgw.model.engine import EngineKind
from llmgw.server.placement.cluster_view import ClusterView, NodeView, _Group, _Node
from llmgw.server.placement.explain import Unschedulable, _room, explain
from llmgw.server.placement.fit import _blocked, _download_need, _fit
from llmgw.server.placement.gang_weights import gang_weights_path

__all__ = ["ClusterView", "NodeView", "Placement", "Unschedulable", "explain", "place"]

_SCAN_HOLDERS_DIRECTLY = 256  # above this many holders, scan buckets instead


@frozen
class Placement:
    members: tuple[Member, ...]
    fabric: str = ""
    holders: int = 0  # members that hold complete weights
    nvlink: int = 0  # members whose GPUs form an NVLink clique
    # A gang: the path at which every member's scan found a complete copy of the model
    # (gang_weights.py); "": none, or not a gang.
    weights_path: str = ""


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
    need = _download_need(view, d)
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
        nodes = view.nodes
        chosen += _scan(group, d, k - len(chosen), taken,
                        lambda nid: nid not in holders and not _room(nodes[nid], need, d.model), False)
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
        weights_path=gang_weights_path(d.model, [c.node.view.inventory.storage for c in chosen])
        if d.nodes > 1 else "",
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
        engine_base = 0
        if _blocked(d):
            found = _free_block(n, taken, ENGINE_PORT_BLOCK)
            if found is None:
                return None
            engine_base = found
            taken.update(range(found, found + ENGINE_PORT_BLOCK))
        if rank == 0 and gang:
            if d.engine == EngineKind.SGLANG:
                # SGLang's dist-init port and, with dp attention, the six after it: all
                # inside the head's own block (model/deployment.py's layout).
                rdzv: int | None = engine_base + SGLANG_DIST_INIT
            else:
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
                port_base=engine_base,
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

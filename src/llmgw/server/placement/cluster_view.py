"""The cluster as placement sees it: one index of the nodes, kept current by explicit
updates rather than rebuilt per pass.

Free-GPU buckets per (fabric, GPU model) and an inverted index of who holds which model,
so that one placement looks at a handful of nodes, not all of them. Building it costs a
second at 50,000 nodes; so the orchestrator builds it once and then feeds it deltas: a
node's view changed (`update_node`), a replica's members taken or given back
(`reserve`, `release`). Whatever the order of those updates, `content()` equals that of
an index built from scratch over the same nodes and replicas (the property tests check
it); only the order in which equal nodes are tried, a tie-break, may differ.

A GPU is free when no replica of ours holds it and it is placeable (healthy, not
releasing: the agent's inventory says); whether its free memory suits a deployment is
placement's question (`_fit`), asked of the few nodes the buckets offer. The memory_free
of a GPU one of our replicas holds counts that engine's use: such a GPU is taken anyway.

A plain value owned by its caller; no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from attrs import frozen

from llmgw.model.deployment import Member, Strategy
from llmgw.model.inventory import Gpu, Inventory, NodeInfo
from llmgw.model.node import NodeState
from llmgw.server.placement.fabrics import usable_fabrics


@frozen
class NodeView:
    """What placement and reconcile know of one node."""

    info: NodeInfo
    inventory: Inventory
    state: NodeState = NodeState.READY
    cordoned: bool = False
    draining: bool = False  # cordoned, and its replicas are being moved away
    # Ports taken by something placement does not see as a replica. (GPUs others hold
    # are in the inventory: Gpu.processes, memory_free, problems, releasing.)
    used_ports: frozenset[int] = frozenset()
    # Ports the node reported in conflict (held by a process that is not ours): never
    # assigned on this node (the server's Node.conflict_ports).
    blocked_ports: frozenset[int] = frozenset()
    silent_since: float | None = None  # when it went silent (suspect/lost); None: unknown


class _Node:
    __slots__ = (
        "addr", "cache", "download_dir", "download_free", "downloading", "fabrics", "fixed", "free",
        "gpu_name", "gpus", "hi", "id", "labels", "lacked", "lo", "out", "ports", "reject", "view",
    )

    def __init__(
        self, node_id: str, view: NodeView, taken_gpus: Mapping[str, int], taken_ports: Mapping[int, int]
    ) -> None:
        inv = view.inventory
        self.id = node_id
        self.view = view
        self.addr = view.info.mgmt_addr
        self.labels = view.info.labels
        self.gpus: dict[str, Gpu] = {g.uuid: g for g in inv.gpus}
        # Never given, whatever our replicas do: unhealthy or releasing (the inventory's).
        self.out = frozenset(g.uuid for g in inv.gpus if not g.placeable)
        self.free = [g.uuid for g in inv.gpus if g.uuid not in self.out and not taken_gpus.get(g.uuid)]
        # Engine kind -> why this node cannot start it.
        self.lacked = {
            e.kind: f"lacked engine {e.kind} ({e.key}: {e.reason})" if e.key
            else f"lacked engine {e.kind} ({e.reason})"
            for e in inv.engines if not e.available
        }
        self.lo, self.hi = view.info.port_range
        # Where an engine with no copy here downloads, and the bytes free there (-1: not
        # known, taken as room enough): placement's space rule (explain._room).
        self.download_dir = inv.storage.download_dir
        self.download_free = inv.storage.download_free
        # Bytes of each model already in download_dir (downloads under way or cut short).
        self.downloading = inv.storage.downloading
        # Ports that no release() gives back: used outside placement, or blocked.
        self.fixed = view.used_ports | {p for p in view.blocked_ports if self.lo <= p <= self.hi}
        self.ports = set(self.fixed)
        self.ports.update(p for p, c in taken_ports.items() if c)
        # Fabrics not down, each with only its healthy HCAs (the HCA watch's problems).
        self.fabrics = usable_fabrics(inv)
        names = [g.name for g in inv.gpus]
        first = names[0] if names else ""
        # The node's GPU model: the most common name (nodes are nearly always uniform).
        self.gpu_name = first if names.count(first) == len(names) else max(names, key=names.count)
        # _fit's answers by (GPU count, engine, args, gpu_memory_min), until the node changes.
        self.cache: dict[tuple[Any, ...], tuple[tuple[str, ...], bool] | None] = {}
        self.reject = ""
        if view.state != NodeState.READY:
            self.reject = f"were {view.state}"
        elif view.draining:
            self.reject = "draining"
        elif view.cordoned:
            self.reject = "cordoned"


class _Group:
    """Schedulable nodes bucketed by free GPU count."""

    __slots__ = ("buckets", "ids")

    def __init__(self) -> None:
        self.buckets: dict[int, dict[str, _Node]] = {}
        self.ids: set[str] = set()

    def add(self, n: _Node) -> None:
        self.buckets.setdefault(len(n.free), {})[n.id] = n
        self.ids.add(n.id)

    def remove(self, n: _Node) -> None:
        b = self.buckets.get(len(n.free))
        if b is not None:
            b.pop(n.id, None)
        self.ids.discard(n.id)

    def scan(self, need: int, strategy: Strategy) -> Iterator[_Node]:
        counts = [c for c, b in self.buckets.items() if c >= need and b]
        counts.sort(reverse=strategy == Strategy.SPREAD)
        for c in counts:
            # No copy: a placement only reads the index (reserve comes after), and it
            # stops after a few nodes; copying a bucket of 40,000 cost more than that.
            yield from self.buckets[c].values()

    def content(self) -> tuple[dict[int, frozenset[str]], frozenset[str]]:
        return {c: frozenset(b) for c, b in self.buckets.items() if b}, frozenset(self.ids)


class ClusterView:
    """An index of the nodes; reserve() what you place and update_node() what changes."""

    def __init__(self, nodes: Mapping[str, NodeView] | None = None) -> None:
        self.nodes: dict[str, _Node] = {}
        self.all = _Group()
        self.groups: dict[tuple[str, str], _Group] = {}
        self.holders: dict[str, set[str]] = {}
        # What replicas hold, per node id, counted (two replicas on one GPU, a state
        # that should not happen, still gives it back only when both are gone). Kept for
        # nodes not known too: a node whose replicas were restored before its Hello
        # starts with them taken.
        self.taken_gpus: dict[str, dict[str, int]] = {}
        self.taken_ports: dict[str, dict[int, int]] = {}
        # Bumped whenever room may have grown (a release, a node changed): an answer of
        # "no room" is good for as long as it stays the same.
        self.grown = 0
        for node_id in sorted(nodes or {}):
            self._add(node_id, nodes[node_id])  # type: ignore[index]

    # ---- updates ----

    def update_node(self, node_id: str, view: NodeView | None) -> None:
        """The node's view is now `view` (None: the node is gone). Its replicas' GPUs and
        ports stay taken: they are the replicas', not the node's."""
        old = self.nodes.pop(node_id, None)
        if old is not None:
            if not old.reject:
                self._unindex(old)
            for key in _held(old.view):
                holders = self.holders.get(key)
                if holders is not None:
                    holders.discard(node_id)
                    if not holders:
                        del self.holders[key]
        if view is not None:
            self._add(node_id, view)
        self.grown += 1

    def reserve(self, members: Iterable[Member]) -> None:
        """Take the members' GPUs and ports."""
        for m in members:
            self._change(m, +1)

    def release(self, members: Iterable[Member]) -> None:
        """Give the members' GPUs and ports back."""
        gave = False
        for m in members:
            self._change(m, -1)
            gave = True
        if gave:
            self.grown += 1

    # ---- reads ----

    def holds(self, node_id: str, model: str) -> bool:
        return node_id in self.holders.get(model, ())

    def model_size(self, model: str) -> int:
        """Bytes of a complete copy of `model` some node holds (the copies of one model
        are alike; the largest seen is taken); 0: no node holds one, size unknown."""
        size = 0
        for nid in self.holders.get(model, ()):
            for copy in self.nodes[nid].view.inventory.storage.models:
                if copy.complete and model in (copy.name, copy.path):
                    size = max(size, copy.size)
            if size:
                return size
        return size

    def free_gpus(self, node_id: str) -> tuple[str, ...]:
        return tuple(self.nodes[node_id].free)

    def content(self) -> dict[str, Any]:
        """Everything placement reads, as plain values: equal for two views of the same
        nodes and replicas however each was arrived at."""
        return {
            "nodes": {
                nid: (n.view, tuple(n.free), frozenset(n.ports), n.reject, tuple(sorted(n.fabrics)),
                      n.gpu_name, n.fixed)
                for nid, n in self.nodes.items()
            },
            "all": self.all.content(),
            "groups": {k: g.content() for k, g in self.groups.items() if g.ids},
            "holders": {k: frozenset(v) for k, v in self.holders.items() if v},
            "taken_gpus": _nonzero(self.taken_gpus),
            "taken_ports": _nonzero(self.taken_ports),
        }

    # ---- inside ----

    def _add(self, node_id: str, view: NodeView) -> None:
        n = _Node(node_id, view, self.taken_gpus.get(node_id, {}), self.taken_ports.get(node_id, {}))
        self.nodes[node_id] = n
        for key in _held(view):
            self.holders.setdefault(key, set()).add(node_id)
        if not n.reject:
            self._index(n)

    def _index(self, n: _Node) -> None:
        self.all.add(n)
        for fabric in n.fabrics:
            self.groups.setdefault((fabric, n.gpu_name), _Group()).add(n)

    def _unindex(self, n: _Node) -> None:
        self.all.remove(n)
        for fabric in n.fabrics:
            key = (fabric, n.gpu_name)
            group = self.groups[key]
            group.remove(n)
            if not group.ids:
                del self.groups[key]

    def _change(self, m: Member, step: int) -> None:
        gpus = self.taken_gpus.setdefault(m.node_id, {})
        ports = self.taken_ports.setdefault(m.node_id, {})
        for u in m.gpus:
            _count(gpus, u, step)
        bound = m.bound_ports()
        for p in bound:
            _count(ports, p, step)
        if not gpus:
            del self.taken_gpus[m.node_id]
        if not ports:
            del self.taken_ports[m.node_id]
        n = self.nodes.get(m.node_id)
        if n is None:
            return
        indexed = not n.reject
        if indexed:
            self._unindex(n)
        out = n.out
        n.free = [u for u in n.gpus if u not in out and not gpus.get(u)]
        for p in bound:
            if ports.get(p):
                n.ports.add(p)
            elif p not in n.fixed:
                n.ports.discard(p)
        n.cache.clear()
        if indexed:
            self._index(n)


def _held(view: NodeView) -> list[str]:
    """The keys (model name and path) of every complete copy of weights the node holds."""
    out = []
    for copy in view.inventory.storage.models:
        if copy.complete:
            out += [copy.name, copy.path]
    return out


def _count(counts: dict[Any, int], key: Any, step: int) -> None:
    c = counts.get(key, 0) + step
    if c > 0:
        counts[key] = c
    else:
        counts.pop(key, None)  # a release of what was never taken is a no-op


def _nonzero(taken: Mapping[str, Mapping[Any, int]]) -> dict[str, dict[Any, int]]:
    return {nid: dict(c) for nid, c in taken.items() if c}


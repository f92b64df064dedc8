"""What reconcile keeps between passes, so that a pass costs what changed, not the cluster.

One ReconcileState holds the nodes as last told (views and engine reports), the placement
index over them (cluster_view.py, built on first need and then kept current), the
replicas as the last pass left them with maps from node and deployment to replica ids,
and the dirty marks: nodes, deployments and replicas that changed since the last pass;
and the nodes draining or with an unhealthy GPU (what a drain moves replicas off).
Its owner feeds it deltas through the methods below (a node's view or reports changed,
a deployment changed, replicas changed outside a pass); reconcile_dirty (reconcile.py)
then looks only at what they touch, plus what time made due (a backoff's end, a
failure count to forget), and a pass with nothing dirty and nothing due does nothing.

A plain structure with explicit update methods, no I/O and no clock; it is not shared
between threads: its owner hands it to one pass at a time.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping

from attrs import frozen

from llmgw.model.deployment import Deployment, Replica, ReplicaState
from llmgw.model.engine import EngineReport
from llmgw.model.inventory import Gpu
from llmgw.model.node import NodeState
from llmgw.server.placement.cluster_view import ClusterView, NodeView
from llmgw.server.placement.place import Unschedulable
from llmgw.server.reconcile.drain import DEFAULT_GRACE
from llmgw.server.reconcile.replica_states import BACKING_OFF

S = ReplicaState


@frozen
class NodeDelta:
    """A node as it is now: its view (None: gone) and its latest engine reports."""

    node_id: str
    view: NodeView | None
    reports: tuple[EngineReport, ...] = ()


class ReconcileState:
    def __init__(
        self,
        nodes: Mapping[str, NodeView] | None = None,
        replicas: Mapping[str, Replica] | None = None,
        reports: Mapping[str, Iterable[EngineReport]] | None = None,
        *,
        stable_after: float = 60.0,
        drain_grace: float = DEFAULT_GRACE,
    ) -> None:
        self.nodes: dict[str, NodeView] = dict(nodes or {})
        self.reports: dict[str, tuple[EngineReport, ...]] = {
            n: tuple(rs) for n, rs in (reports or {}).items()}
        # Nodes not ready -> since when (the mass-loss guard counts these, not all nodes).
        self.silent: dict[str, float | None] = {
            n: v.silent_since for n, v in self.nodes.items() if v.state != NodeState.READY}
        self.draining: set[str] = {n for n, v in self.nodes.items() if v.draining}
        # Node id -> its unhealthy GPUs by UUID (only nodes that have one): a replica
        # holding one is moved as a drain moves it (Pass.must_move).
        self.sick: dict[str, dict[str, Gpu]] = {}
        # Node id -> its unhealthy HCAs (the agent's HCA watch, or no active port; only
        # nodes that have one): a gang member riding one is moved the same way.
        self.sick_hcas: dict[str, frozenset[str]] = {}
        # Node id -> until when new gangs and probed replicas avoid it: a pre-flight failed on it
        # (model/preflight.py). Kept by the long-lived state only: a restarted server
        # starts with none, which costs one more failed pre-flight at worst.
        self.avoid: dict[str, float] = {}
        for n, v in self.nodes.items():
            self._note_sick(n, v)
        self.replicas: dict[str, Replica] = {}
        self.on_node: dict[str, set[str]] = {}
        self.of_deployment: dict[str, set[str]] = {}
        self.unplaced: set[str] = set()
        self.timed: dict[str, float] = {}  # replica id -> when time-driven work is due
        self._view: ClusterView | None = None
        # Placement's "no room" answers by (template hash, exclude), with the view's
        # `grown` count they were given at: good until room may have grown.
        self.no_room: dict[tuple[str, frozenset[str]], tuple[int, Unschedulable]] = {}
        self.holding = ""
        # How long a replica stays ready before its failure count is forgotten (the
        # settings' stable_after): the timer `track` sets.
        self.stable_after = stable_after
        self.drain_grace = drain_grace  # the settings' drain_grace: a drain's first look
        self.top_generation = 0  # the highest generation of any replica seen
        # id(spec) -> (a weak reference to it, its template hash): replicas share few
        # spec objects, and hashing one costs a JSON dump; checked by identity on use.
        self._hashes: dict[int, tuple[weakref.ref[Deployment], str]] = {}
        self.dirty_nodes: set[str] = set()
        self.dirty_deployments: set[str] = set()
        self.dirty_replicas: set[str] = set()
        self.everything = True  # a fresh state: the first pass looks at it all
        self.put_replicas(replicas or {})

    # ---- deltas ----

    def node(self, delta: NodeDelta) -> None:
        """A node's view or engine reports changed (or it is gone)."""
        nid, view = delta.node_id, delta.view
        if view is None:
            self.nodes.pop(nid, None)
            self.reports.pop(nid, None)
            self.silent.pop(nid, None)
            self.draining.discard(nid)
            self.sick.pop(nid, None)
            self.sick_hcas.pop(nid, None)
        else:
            self.nodes[nid] = view
            self.reports[nid] = delta.reports
            if view.state == NodeState.READY:
                self.silent.pop(nid, None)
            else:
                self.silent[nid] = view.silent_since
            if view.draining:
                self.draining.add(nid)
            else:
                self.draining.discard(nid)
            self._note_sick(nid, view)
        if self._view is not None:
            self._view.update_node(nid, view)
        self.dirty_nodes.add(nid)

    def _note_sick(self, nid: str, view: NodeView) -> None:
        # Hard problems only: a soft one (a pending row remap, volatile ECC errors) keeps
        # new replicas off the GPU (placement's `placeable`) and moves nothing.
        sick = {g.uuid: g for g in view.inventory.gpus if g.hard_problems}
        if sick:
            self.sick[nid] = sick
        else:
            self.sick.pop(nid, None)
        bad = frozenset(h.name for h in view.inventory.hcas if not h.healthy)
        if bad:
            self.sick_hcas[nid] = bad
        else:
            self.sick_hcas.pop(nid, None)

    def deployment_changed(self, name: str) -> None:
        """The operator applied, scaled or deleted it."""
        self.dirty_deployments.add(name)

    def put_replicas(self, replicas: Mapping[str, Replica]) -> None:
        """Replicas changed outside a pass (adopted, restored): the index takes their GPUs,
        and the next pass looks at them. Ids absent from `replicas` are left alone."""
        for rid, r in replicas.items():
            old = self.replicas.get(rid)
            if self._view is not None:
                if old is not None:
                    self._view.release(old.members)
                self._view.reserve(r.members)
            self.track(rid, old, r)
            self.dirty_replicas.add(rid)
        self.replicas = {**self.replicas, **replicas}

    def wake_at(self, rid: str, when: float) -> None:
        """Look at `rid` again at `when` though nothing else changes (a draining replica
        whose verdict time alone may change: the routers' grace ending, its drain_until)."""
        self.timed[rid] = when

    def mark_everything(self) -> None:
        self.everything = True

    # ---- for the pass ----

    def view(self, replicas: Mapping[str, Replica]) -> ClusterView:
        """The index, built on first need from the nodes and `replicas` (the pass's own,
        as they are at that moment); kept from then on."""
        if self._view is None:
            self._view = ClusterView(self.nodes)
            for r in replicas.values():
                self._view.reserve(r.members)
        return self._view

    @property
    def indexed(self) -> bool:
        return self._view is not None

    @property
    def grown(self) -> int:
        """The index's count of times room was freed (-1 while there is no index)."""
        return self._view.grown if self._view is not None else -1

    def is_clean(self, now: float) -> bool:
        return not (self.everything or self.dirty_nodes or self.dirty_deployments
                    or self.dirty_replicas or self.due(now))

    def due(self, now: float) -> list[str]:
        return [rid for rid, t in self.timed.items() if t <= now]

    def template_hash(self, spec: Deployment) -> str:
        """spec.template_hash(), remembered for as long as the spec object lives."""
        key = id(spec)
        hit = self._hashes.get(key)
        if hit is not None and hit[0]() is spec:
            return hit[1]
        h = spec.template_hash()
        hashes = self._hashes
        hashes[key] = (weakref.ref(spec, lambda ref: _forget(hashes, key, ref)), h)
        return h

    def report(self, node_id: str, replica_id: str, generation: int) -> EngineReport | None:
        for rep in self.reports.get(node_id, ()):
            if rep.replica_id == replica_id and rep.generation == generation:
                return rep
        return None

    def track(self, rid: str, old: Replica | None, new: Replica | None) -> None:
        """Keep the maps from node and deployment to replica ids, and the timers, for one
        replica that went from `old` to `new` (None: absent). The index is the pass's."""
        if old is not None:
            for nid in old.node_ids:
                ids = self.on_node.get(nid)
                if ids is not None:
                    ids.discard(rid)
                    if not ids:
                        del self.on_node[nid]
            if new is None or new.deployment != old.deployment:
                ids = self.of_deployment.get(old.deployment)
                if ids is not None:
                    ids.discard(rid)
                    if not ids:
                        del self.of_deployment[old.deployment]
        self.unplaced.discard(rid)
        self.timed.pop(rid, None)
        if new is None:
            return
        self.top_generation = max(self.top_generation, new.generation)
        for nid in new.node_ids:
            self.on_node.setdefault(nid, set()).add(rid)
        self.of_deployment.setdefault(new.deployment, set()).add(rid)
        if not new.placed:
            self.unplaced.add(rid)
        if not new.placed and (new.spec.gang or new.spec.preflight_mode) and self.avoid:
            # A gang, or a probed single-node replica, waiting while nodes are
            # avoided: looked at again when the first may be tried again, though nothing
            # else changes.
            self.timed[rid] = min(self.avoid.values())
        elif new.state in BACKING_OFF:
            self.timed[rid] = new.backoff_until
        elif new.state == S.READY and new.restarts:
            self.timed[rid] = new.ready_since + self.stable_after
        elif new.state == S.DRAINING:
            # First when the routers' grace ends; that look sets the next (wake_at).
            self.timed[rid] = min(new.drain_since + self.drain_grace, new.drain_until)

    def clean(self) -> None:
        self.everything = False
        self.dirty_nodes.clear()
        self.dirty_deployments.clear()
        self.dirty_replicas.clear()

    def pending(self) -> dict[str, str]:
        return {rid: self.replicas[rid].reason for rid in sorted(self.unplaced)
                if self.replicas[rid].state == S.PENDING}


def _forget(hashes: dict[int, tuple[weakref.ref[Deployment], str]], key: int,
            ref: weakref.ref[Deployment]) -> None:
    if key in hashes and hashes[key][0] is ref:  # not a newer spec at the same address
        del hashes[key]

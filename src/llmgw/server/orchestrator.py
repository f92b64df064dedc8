"""Deployments into engines on nodes: the trio shell around reconcile, placement and the
store.

Passes are coalesced: anything that may change the outcome (a node's Hello, an engine
report, a node's state, a ctl change, a backoff ending) marks the plan dirty, and one
task runs the next pass, persists its result, then sends every node whose desired set
changed its whole new set. A node that says Hello always gets its set, changed or not.

Passes cost what changed (reconcile_state.py): one ReconcileState, with the placement
index, lives across passes. The trio side only collects which nodes and deployments
changed; at the start of a pass it turns the dirty nodes into NodeDeltas, and the worker
thread applies them to the state and runs the pass on it. The state is touched only by
that one thread, one pass at a time (the loop below awaits each pass before the next),
and read here only between passes. A pass that fails drops the state: the next one
builds it afresh from a full snapshot.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import trio
from attrs import evolve

from llmgw.config.server import ServerConfig
from llmgw.model.deployment import Deployment, Replica
from llmgw.model.engine import EngineSpec
from llmgw.model.inventory import Inventory, NodeInfo
from llmgw.model.node import NodeState
from llmgw.server.elastic.autoscaler import Autoscaler, Change
from llmgw.server.peers.sessions import ControlPlane, Node, Outgoing
from llmgw.server.placement.place import NodeView
from llmgw.server.reconcile.rebuild import adoptable, rebuild
from llmgw.server.reconcile.rules import (
    NodeDelta,
    ReconcileResult,
    ReconcileSettings,
    ReconcileState,
    desired_sets,
    reconcile_dirty,
)
from llmgw.server.store.sql import StateStore, StoredEvent
from llmgw.server.tenants.apikeys import ApiKeys
from llmgw.transport.messages import DesiredSet

log = logging.getLogger(__name__)

PASS_GAP = 0.05  # seconds, at least, between reconcile passes


class Orchestrator:
    def __init__(self, cp: ControlPlane, store: StateStore, config: ServerConfig, now: float) -> None:
        self.cp = cp
        self.store = store
        self.config = config
        self.settings = ReconcileSettings(mass_loss_share=config.mass_loss_share,
                                          grace_period=config.lost_after,
                                          drain_grace=config.drain_grace)
        self.deployments: dict[str, Deployment] = store.deployments()
        self.replicas: dict[str, Replica] = store.replicas()
        self.floor = store.generation_floor()
        self.holding = ""
        self.pending: dict[str, str] = {}
        self.next_wake: float | None = None
        self.state_id = store.state_id()
        self.sets: dict[str, tuple[EngineSpec, ...]] = self.desired()
        self.set_generation = 0
        self._dirty = trio.Event()
        self._send: Callable[[list[Outgoing]], None] = lambda out: None
        self._pending_nodes: dict[str, Node] = {}  # to write to the store on the next pass
        # What the store holds of each node (info, inventory), to write only what changed:
        # after a restart every agent says Hello again with what it said before, and
        # rewriting ten thousand unchanged rows was a share of the storm's CPU. The
        # objects are the node's own (replaced by the node's equal, interned copies when
        # a Hello matches), so this costs a tuple per node. Cordon and drain flags are
        # written by Ops.op_cordon alone; `last_seen` is not refreshed by an unchanged Hello
        # (nothing reads it back: a restarted server starts every node's clock afresh).
        self._stored: dict[str, tuple[NodeInfo, Inventory]] = {}
        # What reconcile keeps between passes (None: build it from a snapshot), and what
        # changed since the last pass, collected here on the trio side.
        self.rstate: ReconcileState | None = None
        self._dirty_nodes: set[str] = set()
        self._dirty_deployments: set[str] = set()
        self._adopted: dict[str, Replica] = {}
        self.changed: frozenset[str] = frozenset()  # replica ids the last pass changed
        self.failed_passes = 0
        # Called after each pass with its wall time and the replicas before and after
        # (the metrics); and the newest event of each replica, for the status document.
        self.on_pass: Callable[[float, dict[str, Replica], dict[str, Replica]], None] = \
            lambda cost, before, after: None
        self.last_events: dict[str, StoredEvent] = {}
        # The routers' load reports and the decisions they lead to (elastic deployments); its loop
        # is started beside serve() (service.py).
        self.autoscaler = Autoscaler()
        # Nodes whose Hello reported engines this state has no record of (rebuild.py):
        # their desired set waits for the pass that adopts them.
        self.adopt_from: set[str] = set()
        self.rebuilt: set[str] = set()  # deployments rebuilt from engine records
        self.rebuild_notes: list[str] = []
        # Nodes known from before a restart get the long first grace period to return.
        stored_nodes = store.nodes()
        self._stored.update((nid, (n.info, n.inventory)) for nid, n in stored_nodes.items())
        cp.remember(stored_nodes, now)
        cp.on_node_change = self._node_changed
        cp.on_tick = self._ticked
        cp.on_back = self._node_back
        cp.desired_ids = self.desired_ids
        # API keys and limits: the keys, limits and usage kept in the store
        # (server/tenants/apikeys.py); its ops, as ctl's (ops.py), are put in the control
        # plane's table by the server's assembly (peers/service.py).
        self.apikeys = ApiKeys(store)

    # ---- triggers from the control plane ----

    def _node_changed(self, node: Node, now: float, what: str) -> list[Outgoing]:
        hello = what == "hello"
        if what in ("hello", "inventory"):
            self.store_later(node)
        self.mark_node(node.node_id)
        if hello:
            if any(adoptable(r, self.replicas, self.floor, self.state_id) for r in node.engines.values()):
                self.adopt_from.add(node.node_id)
                return []
            return [self._set_for(node)]
        return []

    def _node_back(self, node: Node, now: float) -> None:
        """A silent node was heard again (its state is ready once more)."""
        self.mark_node(node.node_id)

    def _set_for(self, node: Node) -> Outgoing:
        return (node.routing_id, DesiredSet(self._next_set_generation(), self.sets.get(node.node_id, ())))

    async def adopt(self, now: float) -> list[str]:
        """Adopt what the nodes in `adopt_from` run and this state does not know; their
        desired sets, which were held back, go out after the next pass."""
        asking = {n: self.cp.nodes[n] for n in sorted(self.adopt_from) if n in self.cp.nodes}
        res = rebuild(self.deployments, self.replicas,
                      {n: tuple(node.engines.values()) for n, node in asking.items()},
                      {n: node.info.mgmt_addr for n, node in asking.items()},
                      self.floor, now, frozenset(self.rebuilt), self.state_id)
        changed = [d for name, d in res.deployments.items() if self.deployments.get(name) != d]
        self._dirty_deployments.update(d.name for d in changed)
        self._adopted.update((rid, res.replicas[rid]) for rid in res.adopted)
        for d in changed:
            await trio.to_thread.run_sync(self.store.put_deployment, d, now)
        self.rebuilt.update(res.created)
        events = [StoredEvent(now, res.replicas[rid].deployment, rid,
                              "adopted from the engine its node runs (no record of it here)")
                  for rid in res.adopted]
        events += [StoredEvent(now, name, "", "rebuilt from its engines' records") for name in res.created]
        if events:
            await trio.to_thread.run_sync(self.store.add_events, events)
            self.note_events(events)
        for e in events:
            log.warning("%s%s: %s", e.deployment, f" {e.replica}" if e.replica else "", e.text)
        for note in res.notes:
            log.warning("%s", note)
        self.rebuild_notes = (self.rebuild_notes + list(res.notes))[-20:]
        self.deployments, self.replicas, self.floor = res.deployments, res.replicas, res.generation_floor
        if res.adopted:
            self.sets = self.desired()
        # A gang member whose peers have not said Hello yet keeps its set held, but only
        # for as long as a restarted server waits for nodes to return.
        held = res.waiting if now < self.cp.lost_not_before else frozenset()
        # Only the nodes asked about now: Hellos that came during the awaits above wait
        # for the next pass.
        self.adopt_from = {n for n in self.adopt_from if n in self.cp.nodes} - (set(asking) - held)
        return [n for n in asking if n not in held]

    def _ticked(self, changed: list[tuple[Node, NodeState]], now: float) -> list[Outgoing]:
        for node, _before in changed:
            self._dirty_nodes.add(node.node_id)
        if changed or (self.next_wake is not None and now >= self.next_wake):
            self.mark_dirty()
        return []

    def desired(self) -> dict[str, tuple[EngineSpec, ...]]:
        """Each node's desired set, every spec marked as this state's."""
        return {n: tuple(evolve(s, issuer=self.state_id) for s in specs)
                for n, specs in desired_sets(self.replicas.values()).items()}

    def desired_ids(self, node_id: str) -> set[str]:
        return {spec.replica_id for spec in self.sets.get(node_id, ())}

    def mark_dirty(self) -> None:
        self._dirty.set()

    def mark_node(self, node_id: str) -> None:
        """The node's view or engine reports changed: the next pass looks at it."""
        self._dirty_nodes.add(node_id)
        self._dirty.set()

    def mark_deployment(self, name: str) -> None:
        self._dirty_deployments.add(name)
        self._dirty.set()

    def _next_set_generation(self) -> int:
        self.set_generation += 1
        return self.set_generation

    def store_later(self, node: Node) -> None:
        """Write the node's info and inventory on the next pass, unless the store has them."""
        nid = node.node_id
        now = (node.info, node.inventory)
        if self._stored.get(nid) == now:  # element by element, identity first: cheap
            # Keep the node's own (interned) objects rather than the copies read back from
            # the store; a write still pending for it would only say the same again.
            self._stored[nid] = now
            self._pending_nodes.pop(nid, None)
            return
        self._pending_nodes[nid] = node

    async def _write_nodes(self) -> None:
        nodes, self._pending_nodes = self._pending_nodes, {}
        if not nodes:
            return
        # Taken now, and counted as stored now: a Hello that comes while the write runs
        # in its thread is compared with what this write puts there.
        rows = [(n.info, n.inventory, n.last_seen) for n in nodes.values()]
        before = {nid: self._stored.get(nid) for nid in nodes}
        for nid, (info, inventory, _seen) in zip(nodes, rows, strict=True):
            self._stored[nid] = (info, inventory)
        try:
            await trio.to_thread.run_sync(self.store.put_nodes, rows)
        except BaseException:
            # Not written: the store has what it had, and these nodes are written again.
            for nid, was in before.items():
                if was is None:
                    self._stored.pop(nid, None)
                else:
                    self._stored[nid] = was
                self._pending_nodes.setdefault(nid, nodes[nid])
            raise

    # ---- the pass ----

    @staticmethod
    def node_view(n: Node) -> NodeView:
        return NodeView(info=n.info, inventory=n.inventory, state=n.state, cordoned=n.cordoned,
                        draining=n.draining, silent_since=n.silent_since,
                        blocked_ports=frozenset(n.conflict_ports))

    def node_views(self) -> dict[str, NodeView]:
        return {n.node_id: self.node_view(n) for n in self.cp.nodes.values()}

    def _reconcile_in_thread(self, now: float) -> Callable[[], tuple[ReconcileState, ReconcileResult]]:
        """The pass to run in the worker, with what it needs taken here, on the trio side:
        values that do not change under it (views, report tuples, the deployments copied)."""
        deployments = dict(self.deployments)
        dirty_deps, self._dirty_deployments = self._dirty_deployments, set()
        dirty_nodes, self._dirty_nodes = self._dirty_nodes, set()
        adopted, self._adopted = self._adopted, {}
        settings, floor, state = self.settings, self.floor, self.rstate
        if state is None:  # first pass, or after a failed one: everything, from a snapshot
            views = self.node_views()
            reports = {n.node_id: tuple(n.engines.values()) for n in self.cp.nodes.values()}
            replicas = self.replicas

            def fresh() -> tuple[ReconcileState, ReconcileResult]:
                st = ReconcileState(views, replicas, reports, stable_after=settings.stable_after,
                                    drain_grace=settings.drain_grace)
                return st, reconcile_dirty(st, deployments, now, settings, floor)
            return fresh
        deltas = []
        for nid in dirty_nodes:
            n = self.cp.nodes.get(nid)
            deltas.append(NodeDelta(nid, None) if n is None else
                          NodeDelta(nid, self.node_view(n), tuple(n.engines.values())))

        def step() -> tuple[ReconcileState, ReconcileResult]:
            assert state is not None
            for delta in deltas:
                state.node(delta)
            for name in dirty_deps:
                state.deployment_changed(name)
            state.put_replicas(adopted)
            return state, reconcile_dirty(state, deployments, now, settings, floor)
        return step

    def _set_of(self, node_id: str) -> tuple[EngineSpec, ...]:
        """The node's desired set, from the replicas on it (as desired() would say)."""
        assert self.rstate is not None
        rs = (self.replicas[rid] for rid in self.rstate.on_node.get(node_id, ()))
        specs = desired_sets(rs).get(node_id, ())
        return tuple(evolve(s, issuer=self.state_id) for s in specs)

    async def run_pass(self, now: float) -> tuple[list[Outgoing], list[StoredEvent]]:
        # The pass runs in a thread (a pass that builds the index at 50,000 nodes takes
        # about a second) while the loop goes on answering heartbeats and marking what
        # changes meanwhile dirty for the next pass.
        work = self._reconcile_in_thread(now)
        self.rstate = None  # until the pass returns it: if it fails, it is rebuilt
        self.rstate, result = await trio.to_thread.run_sync(work)
        if result.holding != self.holding:
            (log.warning if result.holding else log.info)(
                "%s", result.holding or "mass-loss guard released")
        self.holding = result.holding
        self.pending = result.pending
        self.next_wake = result.next_wake
        self.replicas = result.replicas
        self.floor = result.generation_floor
        events = [StoredEvent(now, e.deployment, e.replica, e.text) for e in result.events]
        for e in result.events:
            log.info("%s: %s", e.replica, e.text)
        out: list[Outgoing] = []
        self.changed = result.changed
        if result.changed_nodes:
            for node_id in result.changed_nodes:
                specs = self._set_of(node_id)
                if specs:
                    self.sets[node_id] = specs
                else:
                    self.sets.pop(node_id, None)
            for node_id in sorted(result.changed_nodes):
                node = self.cp.nodes.get(node_id)
                if node is not None and node.connected and node.routing_id:
                    out.append((node.routing_id, DesiredSet(self._next_set_generation(),
                                                            self.sets.get(node_id, ()))))
        return out, events

    async def serve(self, send: Callable[[list[Outgoing]], None], clock: Callable[[], float],
                    *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._send = send
        self.mark_dirty()
        task_status.started()
        while True:
            await self._dirty.wait()
            self._dirty = trio.Event()
            await self._write_nodes()
            before = (self.replicas, self.floor)
            started = trio.current_time()
            try:
                owed = await self.adopt(clock()) if self.adopt_from else []
                out, events = await self.run_pass(clock())
                told = {rid for rid, _ in out}
                out += [self._set_for(node) for node in (self.cp.nodes[n] for n in owed)
                        if node.connected and node.routing_id and node.routing_id not in told]
            except Exception:
                # A bug in reconcile costs this pass, not the server: state is as it was,
                # and the next change (or the retry below) runs another, on a reconcile
                # state built afresh (this one may be half-changed).
                self.rstate = None
                self.failed_passes += 1
                log.exception("reconcile pass failed; nothing changed, trying again")
                await trio.sleep(max(PASS_GAP, 1.0))
                self.mark_dirty()
                continue
            cost = trio.current_time() - started
            changed = self.changed
            self.on_pass(cost, {rid: before[0][rid] for rid in changed if rid in before[0]},
                         {rid: self.replicas[rid] for rid in changed if rid in self.replicas})
            self.note_events(events)
            if events or changed or self.floor != before[1]:
                # Persist before telling anyone: what a node is asked to run survives a crash.
                await trio.to_thread.run_sync(functools.partial(
                    self.store.save_replicas, self.replicas, events=events,
                    generation_floor=self.floor))
            send(out)
            # Coalesce bursts (fifty engines reporting ready, ten thousand agents saying
            # Hello after a restart) into one pass, and keep passes to a third of the time
            # however large the cluster: heartbeats come first.
            await trio.sleep(max(PASS_GAP, 2 * cost))

    # ---- what the ops (ops.py) and the autoscaler change and read ----

    def send(self, out: list[Outgoing]) -> None:
        """Send now, between passes (ctl rediscover and logs); nothing before serve()."""
        self._send(out)

    async def put_replicas(self, d: Deployment, now: float) -> None:
        """The one way a count changes (ctl scale, the autoscaler): persisted first, then
        the reconciler places or drains (a replica removed drains before it stops)."""
        await trio.to_thread.run_sync(self.store.put_deployment, d, now)
        self.deployments[d.name] = d
        self.mark_deployment(d.name)

    async def autoscale_to(self, change: Change, now: float) -> bool:
        """Set what the autoscaler decided, unless the deployment changed meanwhile
        (deleted, pinned, applied with another count, scaled)."""
        d = self.deployments.get(change.deployment)
        if d is None or d.autoscale is None or d.replicas != change.before:
            return False
        events = [StoredEvent(now, d.name, "", f"autoscale: {change.reason}")]
        if change.also is not None:  # a preemption: the taker's side of it
            events.append(StoredEvent(now, change.also[0], "", f"priority: {change.also[1]}"))
        await trio.to_thread.run_sync(self.store.add_events, events)
        await self.put_replicas(evolve(d, replicas=change.after, asleep=change.asleep), now)
        return True

    async def autoscale_loop(self, clock: Callable[[], float],
                             *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The autoscaler's loop (and priorities' preemption), beside serve()."""
        await self.autoscaler.serve(lambda: self.deployments, self.autoscale_to, clock,
                                    lambda: (self.replicas, self.pending), task_status=task_status)

    def note_events(self, events: list[StoredEvent]) -> None:
        for e in events:
            if e.replica:
                self.last_events[e.replica] = e
        if len(self.last_events) > 2 * len(self.replicas) + 100:  # bounded: gone replicas go
            self.last_events = {k: e for k, e in self.last_events.items() if k in self.replicas}

"""One reconcile pass's working state: the replicas as they change, the cluster view
placement reserves from (the ReconcileState's, kept across passes), the events, the
generation counter, the replicas it touched. Shared by reconcile.py and rollout.py (the
per-deployment steps); never escapes a pass.
"""

from __future__ import annotations

from collections.abc import Iterable

from attrs import evolve, frozen

from llmgw.model.deployment import Deployment, Replica, ReplicaState, replica_id
from llmgw.model.node import NodeState
from llmgw.server.placement.fabrics import sick_hcas
from llmgw.server.placement.place import ClusterView, Placement, place
from llmgw.server.reconcile.drain import DEFAULT_GRACE, drain_verdict
from llmgw.server.reconcile.replica_states import ReplicaEvent, drains_first, next_state
from llmgw.server.reconcile.state import ReconcileState

S = ReplicaState
E = ReplicaEvent


@frozen
class ReconcileSettings:
    backoff_base: float = 5.0  # seconds before the first restart
    backoff_cap: float = 300.0
    crashloop_after: int = 3  # consecutive failures before "crash-looping"
    stable_after: float = 60.0  # ready this long: the failure count starts again
    mass_loss_share: float = 0.3
    # One silent node is never evidence against the server's own network, however small
    # the cluster: in a three-node cluster one node is a third of it.
    mass_loss_min_nodes: int = 2
    grace_period: float = 60.0  # the server's lost_after: the mass-loss guard's window
    # Seconds from a drain's start before its idle engine counts as done (drain.py): every
    # router has dropped it from its table and the agent has read its engine since.
    drain_grace: float = DEFAULT_GRACE


@frozen
class Event:
    deployment: str
    replica: str
    text: str


class Pass:
    """One reconcile pass's working state (local to reconcile(); never escapes)."""

    def __init__(self, state: ReconcileState, now: float, settings: ReconcileSettings,
                 floor: int) -> None:
        self.state = state
        self.nodes = state.nodes
        self.now = now
        self.settings = settings
        self.work: dict[str, Replica] = dict(state.replicas)
        self.floor = max(floor, state.top_generation)
        self.events: list[Event] = []
        self.touched: set[str] = set()  # replica ids put or dropped
        self._mine: dict[str, set[str]] = {}  # deployment -> its replica ids, as they change
        self._sorted: dict[str, list[Replica]] = {}  # mine(), until one of them changes
        self._hashes: dict[int, str] = {}  # id(spec) -> template hash, for this pass
        self._used: dict[str, set[int]] = {}  # deployment -> indexes taken (new_replica)
        self._lowest: dict[str, int] = {}  # deployment -> no free index below this

    @property
    def view(self) -> ClusterView:
        """The state's index (built on first need: a steady pass places nothing)."""
        return self.state.view(self.work)

    def mine(self, deployment: str) -> list[Replica]:
        """The deployment's replicas as they are now, by index."""
        out = self._sorted.get(deployment)
        if out is None:
            out = self._sorted[deployment] = sorted((self.work[rid] for rid in self._ids(deployment)),
                                                    key=lambda r: r.index)
        return list(out)

    def _ids(self, deployment: str) -> set[str]:
        ids = self._mine.get(deployment)
        if ids is None:
            ids = self._mine[deployment] = set(self.state.of_deployment.get(deployment, ()))
        return ids

    def hash(self, spec: Deployment) -> str:
        # By id within the pass: every spec it sees stays alive until it ends (held by
        # the state's replicas, the work or the deployments), so no id is reused. A plain
        # dict in front of the state's weakref-checked cache: the rollout asks once per
        # replica, thousands of times a pass (measured: a third of a scale-up's pass).
        h = self._hashes.get(id(spec))
        if h is None:
            h = self._hashes[id(spec)] = self.state.template_hash(spec)
        return h

    def gen(self) -> int:
        self.floor += 1
        return self.floor

    def event(self, r: Replica, text: str) -> None:
        self.events.append(Event(r.deployment, r.id, text))

    def put(self, r: Replica) -> Replica:
        self.work[r.id] = r
        self.touched.add(r.id)
        mine = self._mine.get(r.deployment)
        if mine is not None:
            mine.add(r.id)
        self._sorted.pop(r.deployment, None)
        return r

    def to(self, r: Replica, event: ReplicaEvent, **changes: object) -> Replica:
        """`r` after `event` (the lifecycle table says its state), with `changes`; kept."""
        return self.put(evolve(r, state=next_state(r.state, event), **changes))  # type: ignore[arg-type]

    def drop(self, r: Replica, why: str) -> None:
        if self.state.indexed:
            self.view.release(r.members)
        self.work.pop(r.id, None)
        self.touched.add(r.id)
        # Known from here on even if mine() was not asked yet: a drained replica leaves
        # before its deployment rolls, and must not be found by the roll.
        self._ids(r.deployment).discard(r.id)
        self._sorted.pop(r.deployment, None)
        self._used.get(r.deployment, set()).discard(r.index)
        self._lowest[r.deployment] = min(self._lowest.get(r.deployment, 0), r.index)
        self.event(r, why)

    def retire(self, r: Replica, why: str, drain_timeout: float) -> None:
        """Stop `r` for a reason that is no failure (`why`: "scaled down to 2"). One that
        serves drains first (the lifecycle table's DRAINS_FIRST): it leaves the routers'
        tables and keeps its engines until they are idle or `drain_timeout` seconds pass
        (drain.py; look_at_drain ends it); anything else stops at once, as
        does everything when `drain_timeout` is 0."""
        if r.state == S.DRAINING:
            return  # already leaving; its deadline stands
        if not drains_first(r.state) or drain_timeout <= 0:
            self.drop(r, f"{why}: stopped")
            return
        # The reason shows beside the state ("draining (scaled down to 1; stops ...)").
        text = f"{why}; stops once its requests finish, at most {drain_timeout:g}s"
        r = self.to(r, E.RETIRE, drain_since=self.now, drain_until=self.now + drain_timeout,
                    replaces="", reason=text)
        self.event(r, f"draining: {text}")
        self.look_at_drain(r)  # an engine already gone has nothing to drain

    def look_at_drain(self, r: Replica) -> None:
        """Stop draining `r` if drain.py says so (drained, timed out, a failure); else
        look at it again when time alone may change that."""
        nodes = {m.node_id: self.node_state(m.node_id) for m in r.members}
        reports = {}
        for m in r.members:
            rep = self.state.report(m.node_id, r.id, r.generation)
            if rep is not None:
                reports[m.node_id] = rep
        verdict = drain_verdict(r, self.now, self.settings.drain_grace, nodes, reports)
        if verdict.stop:
            self.drop(r, verdict.stop)
        else:
            self.state.wake_at(r.id, verdict.wake)

    def release(self, r: Replica) -> Replica:
        """Take `r` off its nodes; its state is the caller's to set."""
        if self.state.indexed:
            self.view.release(r.members)
        return self.put(evolve(r, members=(), fabric="", gang_weights=""))

    def unplace(self, r: Replica) -> Replica:
        """Off its nodes, pending, to be placed again."""
        return self.to(self.release(r), E.UNPLACED)

    def place(self, r: Replica, exclude: frozenset[str] = frozenset()) -> Replica:
        """Place an unplaced replica with a fresh generation; PENDING with a reason if none.
        A gang, or a single-node replica that runs a pre-flight, also avoids the nodes
        where a pre-flight failed lately."""
        if (r.spec.gang or r.spec.preflight_mode) and self.state.avoid:
            exclude = exclude | self.avoided()
        key = (self.hash(r.spec), exclude)
        view = self.view
        # A spec that found no room needs no second look until room may have grown.
        cached = self.state.no_room.get(key)
        result = cached[1] if cached and cached[0] == view.grown else place(r.spec, view, exclude=exclude)
        if not isinstance(result, Placement):
            self.state.no_room[key] = (view.grown, result)
            if r.reason != result.reason:
                self.event(r, f"unschedulable: {result.reason}")
            return self.to(r, E.NO_ROOM, reason=result.reason)
        view.reserve(result.members)
        placed = self.to(
            r,
            E.PLACED,
            members=result.members,
            fabric=result.fabric,
            gang_weights=result.weights_path,
            generation=self.gen(),
            reason="",
            placed_at=self.now,
            ready_since=0.0,
        )
        where = ", ".join(m.node_id for m in result.members)
        self.event(placed, f"placed on {where} (generation {placed.generation})")
        return placed

    def new_replica(self, d: Deployment, replaces: str = "") -> Replica:
        # The lowest free index; the search starts where the last one ended (a thousand
        # new replicas cost a thousand steps, not half a million).
        used = self._used.get(d.name)
        if used is None:
            used = self._used[d.name] = {r.index for r in self.mine(d.name)}
        index = self._lowest.get(d.name, 0)
        while index in used:
            index += 1
        used.add(index)
        self._lowest[d.name] = index + 1
        r = Replica(id=replica_id(d.name, index), deployment=d.name, index=index, spec=d)
        r = evolve(r, replaces=replaces)
        self.put(r)
        return self.place(r)

    def node_state(self, node_id: str) -> NodeState:
        v = self.nodes.get(node_id)
        return NodeState.LOST if v is None else v.state

    def draining(self, node_id: str) -> bool:
        v = self.nodes.get(node_id)
        return v is not None and v.draining

    def sick_gpu(self, r: Replica) -> str:
        """The first of `r`'s GPUs the agent reports unhealthy, as "GPU 2 on n3 unhealthy
        (row remap pending)"; empty when none is. Releasing or foreign processes are not
        problems: a replica already there stays."""
        sick = self.state.sick
        if not sick:
            return ""
        for m in r.members:
            bad = sick.get(m.node_id)
            if not bad:
                continue
            for u in m.gpus:
                g = bad.get(u)
                if g is not None:
                    return f"GPU {g.index} on {m.node_id} unhealthy ({_problems(g.hard_problems)})"
        return ""

    def must_move(self, r: Replica) -> str:
        """Why a placed `r` must leave where it is, replacement first (the drain's way,
        rollout.py): a member's node draining ("node n1 draining"), or a GPU it holds
        turned unhealthy; empty: it may stay."""
        for m in r.members:
            if self.draining(m.node_id):
                return f"node {m.node_id} draining"
        return self.sick_gpu(r) or self.sick_hca(r)

    def avoided(self) -> frozenset[str]:
        """The nodes new gangs and probed replicas avoid now (ReconcileState.avoid, expired ones
        dropped)."""
        avoid = self.state.avoid
        for n in [n for n, until in avoid.items() if until <= self.now]:
            del avoid[n]
        return frozenset(avoid)

    def avoid(self, nodes: Iterable[str], seconds: float) -> None:
        """Keep new gangs and probed replicas off `nodes` for `seconds` (one left waiting for room is
        looked at again when the first may be tried again: ReconcileState.track)."""
        until = self.now + seconds
        for n in nodes:
            self.state.avoid[n] = max(until, self.state.avoid.get(n, 0.0))

    def sick_hca(self, r: Replica) -> str:
        """The first of `r`'s members riding an HCA its agent reports unhealthy, as "HCA
        mlx5_0 (port 1 DOWN (Disabled)) on n3 unhealthy"; empty when none does. Its
        replacement is placed on healthy HCAs (the cluster view counts no other)."""
        sick = self.state.sick_hcas
        if not sick:
            return ""
        for m in r.members:
            bad = sick.get(m.node_id)
            hit = [h for h in m.hcas if bad and h in bad]
            if hit:
                v = self.nodes.get(m.node_id)
                lines = sick_hcas(v.inventory, hit) if v is not None else hit
                return f"HCA {', '.join(lines)} on {m.node_id} unhealthy"
        return ""

    def move_exclude(self, r: Replica) -> frozenset[str]:
        """The nodes a moved `r` must not go back to: its draining ones. (An unhealthy GPU
        keeps itself out: placement never gives it; the node's other GPUs still may.)"""
        return frozenset(m.node_id for m in r.members if self.draining(m.node_id))


def _problems(problems: tuple[str, ...]) -> str:
    """A GPU's problems, bounded for an event or a reason (the agent's text, as sent)."""
    text = ", ".join(p[:80] for p in problems[:2])
    if len(problems) > 2:
        text += f", +{len(problems) - 2} more"
    return "".join(c if c.isprintable() else "?" for c in text)

"""One reconcile pass's working state: the replicas as they change, the cluster view
placement reserves from, the events, the generation counter. Shared by reconcile.py and
rollout.py (the per-deployment steps); never escapes a pass.
"""

from __future__ import annotations

from collections.abc import Mapping

from attrs import evolve, frozen

from llmgw.model.deployment import Deployment, Replica, ReplicaState, replica_id
from llmgw.model.node import NodeState

from .placement import ClusterView, NodeView, Placement, Unschedulable, place
from .replica_states import ReplicaEvent, next_state

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


@frozen
class Event:
    deployment: str
    replica: str
    text: str


class Pass:
    """One reconcile pass's working state (local to reconcile(); never escapes)."""

    def __init__(
        self,
        nodes: Mapping[str, NodeView],
        replicas: Mapping[str, Replica],
        now: float,
        settings: ReconcileSettings,
        floor: int,
    ) -> None:
        self.nodes = nodes
        self.now = now
        self.settings = settings
        self.work: dict[str, Replica] = dict(replicas)
        self.floor = max([floor, *(r.generation for r in replicas.values())])
        self.events: list[Event] = []
        self._view: ClusterView | None = None
        # Specs that found no room this pass; valid until something is released.
        self._no_room: dict[tuple[str, frozenset[str]], Unschedulable] = {}

    @property
    def view(self) -> ClusterView:
        """Built on first need (a steady pass places nothing), from the replicas as they are."""
        if self._view is None:
            self._view = ClusterView(self.nodes)
            for r in self.work.values():
                self._view.reserve(r.members)
        return self._view

    def gen(self) -> int:
        self.floor += 1
        return self.floor

    def event(self, r: Replica, text: str) -> None:
        self.events.append(Event(r.deployment, r.id, text))

    def put(self, r: Replica) -> Replica:
        self.work[r.id] = r
        return r

    def to(self, r: Replica, event: ReplicaEvent, **changes: object) -> Replica:
        """`r` after `event` (the lifecycle table says its state), with `changes`; kept."""
        return self.put(evolve(r, state=next_state(r.state, event), **changes))  # type: ignore[arg-type]

    def drop(self, r: Replica, why: str) -> None:
        if self._view is not None:
            self._view.release(r.members)
        if r.members:
            self._no_room.clear()
        self.work.pop(r.id, None)
        self.event(r, why)

    def release(self, r: Replica) -> Replica:
        """Take `r` off its nodes; its state is the caller's to set."""
        if self._view is not None:
            self._view.release(r.members)
        if r.members:
            self._no_room.clear()
        return self.put(evolve(r, members=(), fabric=""))

    def unplace(self, r: Replica) -> Replica:
        """Off its nodes, pending, to be placed again."""
        return self.to(self.release(r), E.UNPLACED)

    def place(self, r: Replica, exclude: frozenset[str] = frozenset()) -> Replica:
        """Place an unplaced replica with a fresh generation; PENDING with a reason if none."""
        key = (r.spec.template_hash(), exclude)
        result = self._no_room.get(key) or place(r.spec, self.view, exclude=exclude)
        if not isinstance(result, Placement):
            self._no_room[key] = result
            if r.reason != result.reason:
                self.event(r, f"unschedulable: {result.reason}")
            return self.to(r, E.NO_ROOM, reason=result.reason)
        self.view.reserve(result.members)
        placed = self.to(
            r,
            E.PLACED,
            members=result.members,
            fabric=result.fabric,
            generation=self.gen(),
            reason="",
            placed_at=self.now,
            ready_since=0.0,
        )
        where = ", ".join(m.node_id for m in result.members)
        self.event(placed, f"placed on {where} (generation {placed.generation})")
        return placed

    def new_replica(self, d: Deployment, replaces: str = "") -> Replica:
        used = {r.index for r in self.work.values() if r.deployment == d.name}
        index = next(i for i in range(len(used) + 1) if i not in used)
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

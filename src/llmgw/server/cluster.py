"""The cluster's state as ctl's handlers (ops.py, gpu_clear.py) and the status document
(status.py) see it: what they read and the few things they may do, and nothing of the
pass loop. The orchestrator is one (it owns the state); the server's assembly
(peers/service.py) hands it to them, so they never import the orchestrator and the
orchestrator never imports them.
"""

from __future__ import annotations

from typing import Protocol

from llmgw.model.deployment import Deployment, Replica
from llmgw.server.elastic.autoscaler import Autoscaler
from llmgw.server.peers.sessions import ControlPlane, Outgoing
from llmgw.server.store.sql import StateStore, StoredEvent
from llmgw.server.tenants.apikeys import ApiKeys


class Cluster(Protocol):
    # Read: handlers change the dicts in place (apply, delete) and say so with mark_*.
    @property
    def cp(self) -> ControlPlane: ...  # the node table, the requests waiting on nodes
    @property
    def store(self) -> StateStore: ...
    @property
    def deployments(self) -> dict[str, Deployment]: ...
    @property
    def replicas(self) -> dict[str, Replica]: ...
    @property
    def pending(self) -> dict[str, str]: ...  # replica id -> why it is not placed
    @property
    def holding(self) -> str: ...  # why the mass-loss guard holds; "" when it does not
    @property
    def last_events(self) -> dict[str, StoredEvent]: ...  # the newest event of each replica
    @property
    def rebuilt(self) -> set[str]: ...  # deployments rebuilt from engine records
    @property
    def rebuild_notes(self) -> list[str]: ...
    @property
    def apikeys(self) -> ApiKeys: ...
    @property
    def autoscaler(self) -> Autoscaler: ...

    # Do.
    def mark_deployment(self, name: str) -> None:
        """The deployment changed: the next pass looks at it."""

    def mark_node(self, node_id: str) -> None:
        """The node's view changed (cordon, drain): the next pass looks at it."""

    async def put_replicas(self, d: Deployment, now: float) -> None:
        """A new replica count, persisted, then placed or drained."""

    def send(self, out: list[Outgoing]) -> None:
        """Send to nodes now, between passes."""

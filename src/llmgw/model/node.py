"""The server's view of a node's liveness."""

from __future__ import annotations

import enum


class NodeState(enum.StrEnum):
    READY = "ready"
    SUSPECT = "suspect"  # missed heartbeats; its engines stay routable while they answer
    LOST = "lost"  # silent past the grace period; its replicas are placed elsewhere

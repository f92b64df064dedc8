"""The node lifecycle, as one table.

ready --(silent for suspect_after)--> suspect --(silent for lost_after)--> lost
any --(authenticated message)--> ready

The same API as the engine and replica tables: TRANSITIONS, next_state, one typed error.
The table is total (every pair is listed), so the error is only ever a bug of ours.
"""

from __future__ import annotations

import enum

from llmgw.errors import LlmgwError
from llmgw.model.node import NodeState


class NodeEvent(enum.StrEnum):
    HEARD = "heard"  # an authenticated message from the node
    SILENT = "silent"  # missed heartbeats
    GONE = "gone"  # silent past the grace period


class InvalidNodeTransition(LlmgwError):
    """An event that cannot happen in the node's current state: a bug of ours."""

    def __init__(self, state: NodeState, event: NodeEvent) -> None:
        self.state = state
        self.event = event
        super().__init__(f"node event {event.value!r} is not valid in state {state.value!r}")


TRANSITIONS: dict[tuple[NodeState, NodeEvent], NodeState] = {
    (NodeState.READY, NodeEvent.HEARD): NodeState.READY,
    (NodeState.SUSPECT, NodeEvent.HEARD): NodeState.READY,
    (NodeState.LOST, NodeEvent.HEARD): NodeState.READY,
    (NodeState.READY, NodeEvent.SILENT): NodeState.SUSPECT,
    (NodeState.SUSPECT, NodeEvent.SILENT): NodeState.SUSPECT,
    (NodeState.LOST, NodeEvent.SILENT): NodeState.LOST,
    (NodeState.READY, NodeEvent.GONE): NodeState.LOST,
    (NodeState.SUSPECT, NodeEvent.GONE): NodeState.LOST,
    (NodeState.LOST, NodeEvent.GONE): NodeState.LOST,
}


def next_state(state: NodeState, event: NodeEvent) -> NodeState:
    try:
        return TRANSITIONS[state, event]
    except KeyError:
        raise InvalidNodeTransition(state, event) from None


def silence_event(silent_for: float, suspect_after: float, lost_after: float) -> NodeEvent | None:
    """Which timer event, if any, `silent_for` seconds of silence amount to."""
    if silent_for >= lost_after:
        return NodeEvent.GONE
    if silent_for >= suspect_after:
        return NodeEvent.SILENT
    return None

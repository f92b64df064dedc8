"""The node lifecycle, as one table.

ready --(silent for suspect_after)--> suspect --(silent for lost_after)--> lost
any --(authenticated message)--> ready

The same API as the engine and replica tables: TRANSITIONS, next_state, one typed error.
The table is total (every pair is listed), so the error is only ever a bug of ours.
Births are the table's too (BIRTHS, `born`): a node first heard is born ready, one the
store remembers from before a restart is born suspect. So is the restart grace (no node
is lost before it ends: `silence_event`) and when a node went silent (`silent_since`),
which the table's owner (ControlPlane, sessions.py) keeps beside each node's state.
"""

from __future__ import annotations

import enum

from llmgw.errors import InternalError
from llmgw.model.node import NodeState


class NodeEvent(enum.StrEnum):
    HEARD = "heard"  # an authenticated message from the node
    SILENT = "silent"  # missed heartbeats
    GONE = "gone"  # silent past the grace period


class NodeBirth(enum.StrEnum):
    JOINED = "joined"  # a Hello from a node this server does not know
    REMEMBERED = "remembered"  # in the store from before a restart, its agent not heard yet


class InvalidNodeTransition(InternalError):
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


# A remembered node starts silent: its agent must say Hello again before anything is
# placed on it, and it has the restart grace to do so before it is lost.
BIRTHS: dict[NodeBirth, NodeState] = {
    NodeBirth.JOINED: NodeState.READY,
    NodeBirth.REMEMBERED: NodeState.SUSPECT,
}


def born(birth: NodeBirth) -> NodeState:
    return BIRTHS[birth]


def next_state(state: NodeState, event: NodeEvent) -> NodeState:
    try:
        return TRANSITIONS[state, event]
    except KeyError:
        raise InvalidNodeTransition(state, event) from None


def silence_event(silent_for: float, suspect_after: float, lost_after: float,
                  in_restart_grace: bool = False) -> NodeEvent | None:
    """Which timer event, if any, `silent_for` seconds of silence amount to. During a
    restarted server's grace (`in_restart_grace`) silence makes a node suspect, never
    lost: its agent may not have had the time to dial the new server yet."""
    if silent_for >= lost_after:
        return NodeEvent.SILENT if in_restart_grace else NodeEvent.GONE
    if silent_for >= suspect_after:
        return NodeEvent.SILENT
    return None


def silent_since(state: NodeState, was: float | None, last_seen: float) -> float | None:
    """When a node in `state` went silent, kept beside its state: None while it is ready;
    once suspect or lost, the time it went silent (`was`, kept through suspect -> lost),
    else the last time it was heard."""
    if state == NodeState.READY:
        return None
    return was if was is not None else last_seen

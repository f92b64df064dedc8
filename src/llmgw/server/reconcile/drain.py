"""When a draining replica stops: one pure rule over plain data.

A replica leaving for a reason that is no failure (scaled down, deleted, replaced, moved
off a draining node) first leaves the endpoint table (server/endpoints.py lists only
what serves), then waits for two things before its engines are stopped:

- every router has dropped it: routers poll the table every `table_poll_interval` (1 s by
  default), and a request one of them sent just before shows in the engine's in-flight
  count at the agent's next read (every health_interval, 2 s by default). `grace` covers
  both: no "idle" seen before drain_since + grace counts;
- its engine reports no request in flight (EngineReport.in_flight == 0: the agent reads
  the engine's own running + waiting figures and reports each change between none and
  some, so a zero it sent earlier still holds unless a later report says otherwise).

It stops sooner on a failure (a member's node lost, an engine that exited or failed to
start: nothing left to wait for) and at drain_until whatever its engine says (an engine
whose count is unknown, such as a custom plan's, always waits that long). An unhealthy
engine is not a reason to stop early: a busy engine's health probe can time out while its
streams still flow, and drain_until bounds the wait.
"""

from __future__ import annotations

from collections.abc import Mapping

from attrs import frozen

from llmgw.model.deployment import Replica
from llmgw.model.engine import EngineReport
from llmgw.model.node import NodeState
from llmgw.server.reconcile.replica_states import ENGINE_ENDED

# Seconds from a drain's start before an idle engine counts as done: two router polls at
# the default 1 s and two of the agent's in-flight reads at the default 2 s.
DEFAULT_GRACE = 6.0


@frozen
class DrainVerdict:
    stop: str  # why it stops now, for its event; "": it goes on draining
    wake: float = 0.0  # when time alone may change the verdict (draining only)


def drain_verdict(
    r: Replica,
    now: float,
    grace: float,
    nodes: Mapping[str, NodeState],
    reports: Mapping[str, EngineReport],
) -> DrainVerdict:
    """The verdict on draining replica `r` at `now`. `nodes`: each member's node state (a
    node absent is lost); `reports`: node id -> the report of `r`'s engine there for its
    generation (absent: none heard)."""
    for m in r.members:
        if nodes.get(m.node_id, NodeState.LOST) == NodeState.LOST:
            return DrainVerdict(f"node {m.node_id} lost while draining: stopped")
        rep = reports.get(m.node_id)
        if rep is not None and rep.state in ENGINE_ENDED:
            why = f" ({rep.reason})" if rep.reason else ""
            return DrainVerdict(f"engine on {m.node_id} {rep.state} while draining{why}: stopped")
    head = reports.get(r.members[0].node_id) if r.members else None
    in_flight = head.in_flight if head is not None else -1
    if now >= r.drain_until:
        left = (f"{in_flight} requests still in flight" if in_flight > 0
                else "its requests not known to be done")
        return DrainVerdict(f"drain_timeout passed with {left}: stopped")
    settled = r.drain_since + grace
    if now >= settled and in_flight == 0:
        return DrainVerdict("drained (no router sends it anything, no request in flight): stopped")
    return DrainVerdict("", min(settled, r.drain_until) if now < settled else r.drain_until)

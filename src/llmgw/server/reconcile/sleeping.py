"""Sleeping replicas (elastic deployments, autoscale.sleep_when_idle), the server's side. Pure.

Where a deployment with `idle_to_zero` would go to zero, one with `sleep_when_idle` stays
at its count and is marked `asleep` (Deployment.asleep, stored like `replicas`): its
replicas take that in place (same generation, as adapters do), so each engine spec says
asleep and the agent POSTs /sleep, keeping the process. The endpoint table lists such a
replica as not ready and the deployment as `cold`, so routers hold its requests and tell
the server at once (a wake); the autoscaler then clears `asleep`, the agent POSTs
/wake_up, and the replica is ready in the table again. vLLM queues what reaches an engine
that is still waking (its paused scheduler), so a held request that goes the moment the
table says ready waits there for the wake, not for an error.
"""

from __future__ import annotations

from attrs import evolve

from llmgw.model.deployment import Deployment, Replica, ReplicaState
from llmgw.server.reconcile.passes import Pass


def refresh_sleep(p: Pass, d: Deployment) -> None:
    """The deployment's replicas take its `asleep` in place (no restart, no new generation)."""
    for r in p.mine(d.name):
        if r.spec.asleep == d.asleep or r.state == ReplicaState.DRAINING:
            continue
        p.put(evolve(r, spec=evolve(r.spec, asleep=d.asleep)))
        p.event(r, "asleep: its engines free their GPU memory and keep their processes"
                   if d.asleep else "woken: its engines take their GPU memory back")


def serving(r: Replica) -> bool:
    """Ready and awake: what the endpoint table may send requests to."""
    return r.state == ReplicaState.READY and not r.spec.asleep

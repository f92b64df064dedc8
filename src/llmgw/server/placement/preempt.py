"""Priorities when GPUs run out (elastic deployments), pure: deployments, replicas and placement's
reasons in, at most one step down of a lower-priority deployment out.

A deployment with a replica that placement could not put anywhere for lack of free GPUs
(its reason says "lacked N free GPUs") may take GPUs from a deployment of lower
`priority` (never equal or higher) that runs more replicas than its autoscale `min`:
that one's count goes down by one, the way the autoscaler lowers it, so its replica
drains first and its GPUs come free for placement. A deployment without autoscale has
no min to go down to: its replicas are never taken.

One step at a time: while any replica drains (GPUs are being freed already), nothing
more is taken; the pass after the drain places the waiting replica, and only if it still
cannot be placed is another taken. The victim's replicas must be of a shape that frees
what the taker needs: as many GPUs per node or more, on as many nodes or more.
"""

from __future__ import annotations

from collections.abc import Mapping

from attrs import frozen

from llmgw.model.deployment import Deployment, Replica, ReplicaState

LACK_OF_GPUS = "free GPU"  # in placement's reason: "0/3 nodes fit: 3 lacked 8 free GPUs"
# Replicas holding GPUs (a pending one holds none).
PLACED = frozenset({ReplicaState.PREFLIGHT, ReplicaState.STARTING, ReplicaState.READY,
                    ReplicaState.UNHEALTHY})


@frozen
class Preemption:
    taker: str
    victim: str
    victim_before: int
    victim_after: int
    victim_reason: str  # the victim's event
    taker_reason: str  # the taker's event


def placed_counts(replicas: Mapping[str, Replica]) -> dict[str, int]:
    """Per deployment, its replicas that hold GPUs."""
    placed: dict[str, int] = {}
    for r in replicas.values():
        if r.state in PLACED:
            placed[r.deployment] = placed.get(r.deployment, 0) + 1
    return placed


def choose(deployments: Mapping[str, Deployment], replicas: Mapping[str, Replica],
           pending: Mapping[str, str], skip: frozenset[str] = frozenset()) -> Preemption | None:
    """`skip`: takers that took already and wait for that to come through (the caller
    remembers: until one more of theirs is placed, or long enough has passed)."""
    if any(r.state == ReplicaState.DRAINING for r in replicas.values()):
        return None
    waiting: dict[str, str] = {}  # deployment -> placement's reason, for lack of GPUs
    for r in replicas.values():
        if r.state == ReplicaState.PENDING and LACK_OF_GPUS in pending.get(r.id, ""):
            waiting.setdefault(r.deployment, pending[r.id])
    placed = placed_counts(replicas)
    takers = sorted((deployments[n] for n in waiting if n in deployments and n not in skip),
                    key=lambda d: (-d.priority, d.name))
    for taker in takers:
        victims = [
            d for d in deployments.values()
            if d.priority < taker.priority and d.autoscale is not None
            and d.replicas > d.autoscale.min and placed.get(d.name, 0) > 0
            and d.gpus_per_node >= taker.gpus_per_node and d.nodes >= taker.nodes
            and not _selector_excludes(taker, d)
        ]
        if not victims:
            continue
        v = min(victims, key=lambda d: (d.priority, -(d.replicas - _min(d)), d.name))
        after = v.replicas - 1
        gpus = f"{taker.gpus_per_node} GPU{'s' if taker.gpus_per_node != 1 else ''}"
        return Preemption(
            taker=taker.name, victim=v.name, victim_before=v.replicas, victim_after=after,
            victim_reason=(f"preempted {v.replicas} -> {after}: {taker.name} (priority "
                           f"{taker.priority}) cannot place a replica ({waiting[taker.name]}); "
                           f"this deployment's priority is {v.priority}, min {_min(v)}"),
            taker_reason=(f"takes {gpus} from {v.name} (priority {v.priority}): {v.name} "
                          f"{v.replicas} -> {after}, its replica drains first; then this "
                          "replica is placed"))
    return None


def _min(d: Deployment) -> int:
    return d.autoscale.min if d.autoscale is not None else d.replicas


def _selector_excludes(taker: Deployment, victim: Deployment) -> bool:
    """The victim's nodes cannot be the taker's: it needs a label value the victim's
    replicas were placed by another value of (a plain, certain case only)."""
    return any(k in victim.selector and victim.selector[k] != v for k, v in taker.selector.items())

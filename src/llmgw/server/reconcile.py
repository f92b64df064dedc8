"""Reconciliation: desired deployments, current replicas and engine reports -> next replicas.

A pure function of data in and data out (time comes in as `now`). The service around
it stores the replicas it returns, records the events, and sends each node in
`changed_nodes` its whole desired set from `desired_sets(replicas)`.

Rules, in the order one pass applies them:
- A replica whose engines exited or failed waits out a capped exponential backoff, then
  starts again with a new generation (a gang is placed afresh; a single node restarts in
  place). After `crashloop_after` failures in a row it shows as crash-looping. One whose
  engine found its port held by another process is placed again at once, elsewhere or on
  another port (the node's blocked ports).
- Gangs live and die together: one member failing or on a lost node stops all of them.
- A suspect node's replicas stay. A lost node's replicas are placed elsewhere with a new
  generation, so the node's desired set no longer holds the old one when it returns.
- Mass-loss guard: more than `mass_loss_share` of nodes silent within one grace period
  holds every re-placement, and `holding` says so.
- Per deployment (rollout.py): a replacement that became ready retires what it replaces,
  and one no longer needed (its target's node is not draining, its spec is current) is
  dropped; scaling adds or removes replicas, stopping what serves nothing first; a
  draining node's replicas get a replacement first; a changed spec rolls one replica at
  a time (surge one, else down then up).

Every change of a replica's state goes through the lifecycle table (replica_states.py).

Generations are issued from one counter (`generation_floor` in, out) so they never
repeat, not even for a replica id that was deleted and made again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from attrs import evolve, field, frozen

from llmgw.model.deployment import Deployment, Replica, ReplicaState
from llmgw.model.engine import EngineReport, EngineSpec, EngineState
from llmgw.model.node import NodeState

from .placement import NodeView
from .reconcile_pass import Event, Pass, ReconcileSettings
from .replica_states import ReplicaEvent
from .rollout import roll_deployment

DEFAULT_SETTINGS = ReconcileSettings()

__all__ = ["Event", "ReconcileResult", "ReconcileSettings", "desired_sets", "reconcile"]

S = ReplicaState
E = ReplicaEvent


@frozen
class ReconcileResult:
    replicas: dict[str, Replica]
    events: tuple[Event, ...] = ()
    changed_nodes: frozenset[str] = frozenset()  # desired set differs from before
    holding: str = ""  # the mass-loss guard's message; empty when not holding
    generation_floor: int = 0  # persist and pass back in
    next_wake: float | None = None  # earliest backoff end: run a pass then
    pending: dict[str, str] = field(factory=dict)  # replica id -> why not placed


def reconcile(
    deployments: Mapping[str, Deployment],
    replicas: Mapping[str, Replica],
    nodes: Mapping[str, NodeView],
    reports: Mapping[str, Iterable[EngineReport]],
    now: float,
    settings: ReconcileSettings = DEFAULT_SETTINGS,
    generation_floor: int = 0,
) -> ReconcileResult:
    """One pass. `reports`: node id -> that node's latest engine reports."""
    p = Pass(nodes, replicas, now, settings, generation_floor)
    holding = _mass_loss(nodes, now, settings)
    by_key: dict[tuple[str, str, int], EngineReport] = {}
    for node_id, rs in reports.items():
        for rep in rs:
            by_key[(node_id, rep.replica_id, rep.generation)] = rep

    for rid in sorted(replicas):
        r = p.work[rid]
        d = deployments.get(r.deployment)
        if d is None:
            p.drop(r, "deployment deleted: stopped")
            continue
        _observe(p, r, by_key, holding)

    for name in sorted(deployments):
        roll_deployment(p, deployments[name])

    new = p.work
    changed = _changed_nodes(replicas, new)
    waits = [r.backoff_until for r in new.values() if r.state in (S.BACKOFF, S.CRASH_LOOPING)]
    return ReconcileResult(
        replicas=new,
        events=tuple(p.events),
        changed_nodes=changed,
        holding=holding,
        generation_floor=p.floor,
        next_wake=min(waits) if waits else None,
        pending={r.id: r.reason for r in new.values() if r.state == S.PENDING},
    )


def _changed_nodes(old: Mapping[str, Replica], new: Mapping[str, Replica]) -> frozenset[str]:
    """Nodes whose desired set differs; looks only at replicas that changed."""
    out: set[str] = set()
    for rid in old.keys() | new.keys():
        a, b = old.get(rid), new.get(rid)
        if a is b:
            continue
        sa = a.engine_specs() if a is not None and a.wants_engines else ()
        sb = b.engine_specs() if b is not None and b.wants_engines else ()
        if sa != sb:
            out.update(spec_node for spec_node, _ in _nodes_of(a, sa) + _nodes_of(b, sb))
    return frozenset(out)


def _nodes_of(r: Replica | None, specs: tuple[EngineSpec, ...]) -> list[tuple[str, EngineSpec]]:
    return [] if r is None else list(zip((m.node_id for m in r.members), specs, strict=False))


def _mass_loss(nodes: Mapping[str, NodeView], now: float, s: ReconcileSettings) -> str:
    """The guard's message when too many nodes went silent within one grace period."""
    if not nodes:
        return ""
    window = 2 * s.grace_period  # silent for up to one grace period before being lost
    silent = sum(
        1
        for v in nodes.values()
        if v.state != NodeState.READY and (v.silent_since is None or v.silent_since >= now - window)
    )
    if silent >= s.mass_loss_min_nodes and silent / len(nodes) > s.mass_loss_share:
        return (
            f"holding: {silent} of {len(nodes)} nodes silent, suspecting the server's own "
            "network; no replica is placed again until they return or an operator acts"
        )
    return ""


def _observe(
    p: Pass, r: Replica, by_key: Mapping[tuple[str, str, int], EngineReport], holding: str
) -> None:
    """Update one replica from its nodes and engine reports."""
    s = p.settings
    if r.state in (S.BACKOFF, S.CRASH_LOOPING):
        if p.now < r.backoff_until:
            return
        p.event(r, f"restarting after backoff (failure {r.restarts})")
        if r.placed and all(p.node_state(m.node_id) == NodeState.READY for m in r.members):
            p.to(r, E.RESTART, generation=p.gen(), placed_at=p.now)
        else:
            p.place(p.unplace(r))
        return
    if not r.placed:
        p.place(r)
        return
    lost = [m.node_id for m in r.members if p.node_state(m.node_id) == NodeState.LOST]
    if lost:
        if holding:
            if r.state != S.HELD:
                p.event(r, f"node {lost[0]} lost; {holding}")
            p.to(r, E.NODE_LOST_HELD, reason=holding)
            return
        p.event(r, f"node {', '.join(lost)} lost: placing again")
        p.place(p.unplace(r), exclude=frozenset(lost))
        return
    states: list[EngineState | None] = []
    failed: EngineReport | None = None
    for m in r.members:
        if p.node_state(m.node_id) != NodeState.READY:
            states.append(None)  # suspect: no news is not bad news
            continue
        rep = by_key.get((m.node_id, r.id, r.generation))
        if rep is not None and rep.state in (EngineState.EXITED, EngineState.FAILED):
            failed = failed or rep
        states.append(rep.state if rep else EngineState.STARTING)
    if failed is not None and failed.conflict_port:
        # Not the engine's fault: another process holds its port. Placed again at once,
        # with no backoff and no restart counted; placement avoids the node's blocked ports.
        node_id = next(m.node_id for m in r.members
                       if by_key.get((m.node_id, r.id, r.generation)) is failed)
        p.event(r, f"port {failed.conflict_port} on {node_id} is taken ({failed.reason}): placing again")
        p.place(p.unplace(r))
        return
    if failed is not None:
        n = r.restarts + 1
        delay = min(s.backoff_cap, s.backoff_base * 2 ** (n - 1))
        why = failed.reason or (
            f"exit code {failed.exit_code}" if failed.exit_code is not None else str(failed.state)
        )
        p.event(r, f"{failed.state}: {why}; restart {n} in {delay:g}s")
        r = p.to(
            r,
            E.CRASH_LOOP if n >= s.crashloop_after else E.FAILED,
            restarts=n,
            backoff_until=p.now + delay,
            last_log_tail=failed.log_tail or r.last_log_tail,
            reason=why,
            ready_since=0.0,
        )
        if r.spec.nodes > 1:
            p.release(r)  # a gang stops whole, and is placed afresh
        return
    known = [st for st in states if st is not None]
    if known and len(known) == len(states) and all(st == EngineState.READY for st in known):
        if r.state != S.READY:
            p.event(r, "ready")
            r = p.to(r, E.ENGINES_READY, ready_since=p.now, reason="")
        if r.restarts and p.now - r.ready_since >= s.stable_after:
            p.put(evolve(r, restarts=0))
    elif any(st == EngineState.UNHEALTHY for st in known):
        p.to(r, E.ENGINE_UNHEALTHY)
    elif len(known) == len(states):
        p.to(r, E.ENGINES_STARTING)
    elif r.state == S.HELD:
        p.to(r, E.NODE_BACK, reason="")
    # Otherwise some members' nodes are suspect: no news, no change.


def desired_sets(
    replicas: Iterable[Replica], nodes: Iterable[str] = ()
) -> dict[str, tuple[EngineSpec, ...]]:
    """Each node's whole desired engine set; every id in `nodes` is present (maybe empty)."""
    out: dict[str, list[EngineSpec]] = {n: [] for n in nodes}
    for r in replicas:
        if not r.wants_engines:
            continue
        for m, spec in zip(r.members, r.engine_specs(), strict=True):
            out.setdefault(m.node_id, []).append(spec)
    return {n: tuple(sorted(specs, key=lambda s: s.key)) for n, specs in out.items()}

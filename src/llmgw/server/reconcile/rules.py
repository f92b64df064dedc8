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
- A draining replica (a stop that is no failure: rollout.py's Pass.retire) is out of the
  routers' tables; it stops once drain.py says so: its engine idle after the routers'
  grace, its drain_timeout passed, or a failure.
- Per deployment (rollout.py): a replacement that became ready retires what it replaces,
  and one no longer needed (its target's node is not draining, its spec is current) is
  dropped; scaling adds or removes replicas, stopping what serves nothing first; a
  draining node's replicas get a replacement first; a changed spec rolls one replica at
  a time (surge one, else down then up). A replica holding a GPU that turned unhealthy
  (the agent lists a problem on it) moves the way a drain moves it: a replacement first,
  the old one stopped once that is ready; one in backoff restarts elsewhere, not in
  place. A GPU only releasing, or held by another process, moves nothing.

Every change of a replica's state goes through the lifecycle table (replica_states.py).

Generations are issued from one counter (`generation_floor` in, out) so they never
repeat, not even for a replica id that was deleted and made again.

Two ways in. `reconcile` takes a snapshot and looks at everything (tests, tools).
`reconcile_dirty` takes a ReconcileState kept across passes (the orchestrator's) and
looks only at what changed since the last pass: the replicas on dirty nodes, of dirty
deployments, marked themselves, or whose timer is due, plus those waiting for room;
then it rolls only the deployments of what it looked at. A replica that nothing touched
would come out of its rules unchanged, so the result is the same as a full pass's; a
pass with nothing dirty and nothing due returns at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from attrs import evolve, field, frozen

from llmgw.backoff import exponential
from llmgw.model.deployment import Deployment, Replica, ReplicaState
from llmgw.model.engine import EngineReport, EngineSpec, EngineState
from llmgw.model.node import NodeState
from llmgw.model.preflight import AVOID_SECONDS, port_in_use
from llmgw.model.preflight import failure as preflight_failure
from llmgw.server.placement.place import NodeView
from llmgw.server.reconcile.passes import Event, Pass, ReconcileSettings
from llmgw.server.reconcile.replica_states import (
    BACKING_OFF,
    ENGINE_ENDED,
    ReplicaEvent,
    engines_event,
    wants_engines,
)
from llmgw.server.reconcile.rollout import roll_deployment
from llmgw.server.reconcile.state import NodeDelta, ReconcileState

DEFAULT_SETTINGS = ReconcileSettings()

__all__ = ["Event", "NodeDelta", "ReconcileResult", "ReconcileSettings", "ReconcileState",
           "desired_sets", "reconcile", "reconcile_dirty"]

S = ReplicaState
E = ReplicaEvent


@frozen
class ReconcileResult:
    replicas: dict[str, Replica]
    events: tuple[Event, ...] = ()
    changed_nodes: frozenset[str] = frozenset()  # desired set differs from before
    holding: str = ""  # the mass-loss guard's message; empty when not holding
    generation_floor: int = 0  # persist and pass back in
    next_wake: float | None = None  # earliest backoff end (or other timer): run a pass then
    pending: dict[str, str] = field(factory=dict)  # replica id -> why not placed
    changed: frozenset[str] = frozenset()  # replica ids this pass changed, added or removed


def reconcile(
    deployments: Mapping[str, Deployment],
    replicas: Mapping[str, Replica],
    nodes: Mapping[str, NodeView],
    reports: Mapping[str, Iterable[EngineReport]],
    now: float,
    settings: ReconcileSettings = DEFAULT_SETTINGS,
    generation_floor: int = 0,
) -> ReconcileResult:
    """One pass over everything. `reports`: node id -> that node's latest engine reports."""
    state = ReconcileState(nodes, replicas, reports, stable_after=settings.stable_after,
                           drain_grace=settings.drain_grace)
    return reconcile_dirty(state, deployments, now, settings, generation_floor)


def reconcile_dirty(
    state: ReconcileState,
    deployments: Mapping[str, Deployment],
    now: float,
    settings: ReconcileSettings = DEFAULT_SETTINGS,
    generation_floor: int = 0,
) -> ReconcileResult:
    """One pass over what changed since the last; `state` comes out current and clean.
    `state` was made with this `settings.stable_after` and `drain_grace`."""
    holding = _mass_loss(state, now, settings)
    if holding != state.holding:
        state.mark_everything()  # held replicas are let go, or hold with a new count
    replicas = state.replicas
    if state.is_clean(now):
        return ReconcileResult(
            replicas=replicas, holding=holding, generation_floor=max(generation_floor, state.top_generation),
            next_wake=_next_wake(state, holding, now, settings), pending=state.pending())

    if state.everything:
        ids: Iterable[str] = replicas
        rolled = set(deployments)
    else:
        todo = state.dirty_replicas | state.unplaced
        todo.update(state.due(now))
        for n in state.dirty_nodes:
            todo.update(state.on_node.get(n, ()))
        for name in state.dirty_deployments:
            # A changed spec is the rollout's; only a deleted one stops replicas here.
            if name not in deployments:
                todo.update(state.of_deployment.get(name, ()))
        ids = (rid for rid in todo if rid in replicas)
        rolled = {name for name in state.dirty_deployments if name in deployments}
    p = Pass(state, now, settings, generation_floor)
    for _ in range(_ROUNDS):
        grown = state.grown
        for rid in sorted(ids):
            r = p.work[rid]
            d = deployments.get(r.deployment)
            if r.state == S.DRAINING:
                p.look_at_drain(r)
                if d is not None:
                    rolled.add(r.deployment)
                continue
            if d is None:
                p.retire(r, "deployment deleted", r.spec.drain_timeout)
                continue
            rolled.add(r.deployment)
            _observe(p, r, holding)
        for name in sorted(rolled):
            roll_deployment(p, deployments[name])
        if state.grown == grown:
            break
        # Room this round freed (a deleted deployment, a scale-down, a replacement that
        # took over) goes to what waits for room in this pass, not at the next event;
        # then their deployments roll again (a drain that was stuck moves on).
        ids = [rid for rid in p.touched | state.unplaced if _waits_for_room(p.work.get(rid))]
        rolled = set()
        if not ids:
            break

    new = p.work
    changed = {rid for rid in p.touched if replicas.get(rid) is not new.get(rid)}
    for rid in changed:
        state.track(rid, replicas.get(rid), new.get(rid))
    state.replicas = new
    state.holding = holding
    state.clean()
    return ReconcileResult(
        replicas=new,
        events=tuple(p.events),
        changed_nodes=_changed_nodes(replicas, new, changed),
        holding=holding,
        generation_floor=p.floor,
        next_wake=_next_wake(state, holding, now, settings),
        pending=state.pending(),
        changed=frozenset(changed),
    )


_ROUNDS = 3  # observe-and-roll rounds in one pass, while the rollout frees room


def _waits_for_room(r: Replica | None) -> bool:
    return r is not None and not r.placed and r.state not in BACKING_OFF


def _next_wake(state: ReconcileState, holding: str, now: float, s: ReconcileSettings) -> float | None:
    """When time alone changes something: a backoff ends, a failure count is forgotten,
    or (while holding) a silent node stops counting towards the mass-loss guard."""
    waits = [t for t in state.timed.values() if t > now]
    if holding:
        window = 2 * s.grace_period
        waits += [t + window for t in state.silent.values() if t is not None and t + window >= now]
    return min(waits) if waits else None


def _changed_nodes(
    old: Mapping[str, Replica], new: Mapping[str, Replica], ids: Iterable[str]
) -> frozenset[str]:
    """Nodes whose desired set differs; looks only at the replicas `ids` that changed."""
    out: set[str] = set()
    for rid in ids:
        a, b = old.get(rid), new.get(rid)
        sa = a.engine_specs() if a is not None and wants_engines(a) else ()
        sb = b.engine_specs() if b is not None and wants_engines(b) else ()
        if sa != sb:
            out.update(spec_node for spec_node, _ in _nodes_of(a, sa) + _nodes_of(b, sb))
    return frozenset(out)


def _nodes_of(r: Replica | None, specs: tuple[EngineSpec, ...]) -> list[tuple[str, EngineSpec]]:
    return [] if r is None else list(zip((m.node_id for m in r.members), specs, strict=False))


def _mass_loss(state: ReconcileState, now: float, s: ReconcileSettings) -> str:
    """The guard's message when too many nodes went silent within one grace period."""
    total = len(state.nodes)
    if not total:
        return ""
    window = 2 * s.grace_period  # silent for up to one grace period before being lost
    silent = sum(1 for since in state.silent.values() if since is None or since >= now - window)
    if silent >= s.mass_loss_min_nodes and silent / total > s.mass_loss_share:
        return (
            f"holding: {silent} of {total} nodes silent, suspecting the server's own "
            "network; no replica is placed again until they return or an operator acts"
        )
    return ""


def _observe(p: Pass, r: Replica, holding: str) -> None:
    """Update one replica from its nodes and engine reports."""
    s = p.settings
    if r.state in BACKING_OFF:
        if p.now < r.backoff_until:
            return
        p.event(r, f"restarting after backoff (failure {r.restarts})")
        sick = p.sick_gpu(r) or p.sick_hca(r)
        if sick:  # not in place on a GPU or HCA that turned unhealthy: elsewhere
            p.event(r, f"{sick}: placing again")
            p.place(p.unplace(r))
        elif r.placed and all(p.node_state(m.node_id) == NodeState.READY for m in r.members):
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
    probes: list[str] = []  # each member's pre-flight as reported ("" unheard or none)
    failed: EngineReport | None = None
    for m in r.members:
        if p.node_state(m.node_id) != NodeState.READY:
            states.append(None)  # suspect: no news is not bad news
            probes.append("")
            continue
        rep = p.state.report(m.node_id, r.id, r.generation)
        if rep is not None and rep.state in ENGINE_ENDED:
            # A member whose port was taken is the cause (a gang head whose pre-flight could
            # not bind the rendezvous port: the others only time out waiting for it).
            if failed is None or (rep.conflict_port and not failed.conflict_port):
                failed = rep
        states.append(rep.state if rep else EngineState.STARTING)
        probes.append(rep.preflight if rep else "")
    event = engines_event(r.state, states, probes)
    if event == E.PREFLIGHT_RUNNING and r.state != S.PREFLIGHT:
        p.event(r, f"pre-flight: the probe runs on {', '.join(r.node_ids)}")
    elif r.state == S.PREFLIGHT and event not in (None, E.PREFLIGHT_RUNNING, E.FAILED):
        p.event(r, "pre-flight " + "; ".join(f"{m.node_id} {pf or 'not heard'}"
                                              for m, pf in zip(r.members, probes, strict=True)))
    if event == E.FAILED and failed is not None:
        _failed(p, r, failed)
        return
    if event == E.ENGINES_READY:
        if r.state != S.READY:
            p.event(r, "ready")
            r = p.to(r, E.ENGINES_READY, ready_since=p.now, reason="")
        if r.restarts and p.now - r.ready_since >= s.stable_after:
            p.put(evolve(r, restarts=0))
    elif event == E.NODE_BACK:
        p.to(r, E.NODE_BACK, reason="")
    elif event is not None:
        p.to(r, event)
    # None: some members' nodes are suspect: no news, no change.


def _failed(p: Pass, r: Replica, rep: EngineReport) -> None:
    """A member's engine ended badly (`rep`, the first such report): count it and back off,
    or place again at once when the engine is not to blame."""
    s = p.settings
    if rep.conflict_port:
        # Not the engine's fault: another process holds its port. Placed again at once,
        # with no backoff and no restart counted; placement avoids the node's blocked ports.
        node_id = next(m.node_id for m in r.members
                       if p.state.report(m.node_id, r.id, r.generation) is rep)
        why = preflight_failure(rep.exit_code, rep.log_tail) or rep.reason
        p.event(r, f"port {rep.conflict_port} on {node_id} is taken ({why}): placing again"
                   + (" on another port, avoiding no node" if r.spec.preflight_mode else ""))
        p.place(p.unplace(r))
        return
    if r.spec.preflight_mode and r.restarts + 1 < s.crashloop_after:
        why = preflight_failure(rep.exit_code, rep.log_tail)
        if why and port_in_use(why):
            # The rendezvous port was taken (a report with conflict_port went the way
            # above; this one's agent did not say which): the port's fault, not the
            # nodes'. No node is avoided; counted, so that a port taken again and again
            # still ends in a crash loop.
            p.event(r, f"pre-flight: {why}; placing again, avoiding no node")
            r = p.put(evolve(r, restarts=r.restarts + 1, last_log_tail=rep.log_tail,
                             ready_since=0.0))
            p.place(p.unplace(r))
            return
        if why:
            # The collective check failed: the nodes or the links between them (a gang's
            # fabric, one node's NVLink or PCIe), not the engine. Counted as a failure, but
            # placed again at once, away from these nodes for a while (every member's
            # probe fails alike, so all of them).
            nodes = r.node_ids
            where = f"fabric {r.fabric or '-'}" if r.spec.gang else "its GPUs' links on one node"
            p.event(r, f"pre-flight failed on {', '.join(nodes)} ({where}): {why}; "
                       f"avoiding them for {AVOID_SECONDS:g}s, placing again")
            p.avoid(nodes, AVOID_SECONDS)
            r = p.put(evolve(r, restarts=r.restarts + 1, last_log_tail=rep.log_tail,
                             ready_since=0.0))
            p.place(p.unplace(r))
            return
    n = r.restarts + 1
    delay = exponential(n - 1, s.backoff_base, s.backoff_cap)
    why = rep.reason or (
        f"exit code {rep.exit_code}" if rep.exit_code is not None else str(rep.state))
    p.event(r, f"{rep.state}: {why}; restart {n} in {delay:g}s")
    r = p.to(
        r,
        E.CRASH_LOOP if n >= s.crashloop_after else E.FAILED,
        restarts=n,
        backoff_until=p.now + delay,
        last_log_tail=rep.log_tail or r.last_log_tail,
        reason=why,
        ready_since=0.0,
    )
    if r.spec.nodes > 1:
        p.release(r)  # a gang stops whole, and is placed afresh


def desired_sets(
    replicas: Iterable[Replica], nodes: Iterable[str] = ()
) -> dict[str, tuple[EngineSpec, ...]]:
    """Each node's whole desired engine set; every id in `nodes` is present (maybe empty)."""
    out: dict[str, list[EngineSpec]] = {n: [] for n in nodes}
    for r in replicas:
        if not wants_engines(r):
            continue
        for m, spec in zip(r.members, r.engine_specs(), strict=True):
            out.setdefault(m.node_id, []).append(spec)
    return {n: tuple(sorted(specs, key=lambda s: s.key)) for n, specs in out.items()}

"""Per-deployment steps of a reconcile pass: replacements, scaling, drain, rolling update.

Slots are the replicas that count towards `replicas`; a replacement (`replaces` set) is a
surge replica that takes over its slot once ready: the old one stops only then. A
replacement is wanted while its target must move (Pass.must_move: its node drains, a
GPU it holds turned unhealthy, or an HCA a member rides did) or runs an outdated spec;
once neither holds (an uncordon, a healthy GPU or HCA again, a spec put back) it is
dropped unless it is already ready. States
change only through the lifecycle table (replica_states.py).

Every stop here is no failure, so it goes through Pass.retire: a ready replica drains
(out of the routers' tables, its requests finish) before it is stopped; a draining one
is no slot, is never moved, replaced or rolled, and leaves by Pass.look_at_drain.
"""

from __future__ import annotations

from attrs import evolve

from llmgw.model.deployment import Deployment, Replica, ReplicaState
from llmgw.server.reconcile.adapters import refresh_adapters
from llmgw.server.reconcile.passes import Pass
from llmgw.server.reconcile.sleeping import refresh_sleep

S = ReplicaState


def roll_deployment(p: Pass, d: Deployment) -> None:
    refresh_adapters(p, d)
    refresh_sleep(p, d)
    _settle_replacements(p, d)
    _drop_unneeded_replacements(p, d)
    _scale(p, d)
    _drain(p, d)
    _roll(p, d)


def _mine(p: Pass, d: Deployment) -> list[Replica]:
    """The deployment's replicas that stay: draining ones are on their way out."""
    return [r for r in p.mine(d.name) if r.state != S.DRAINING]


def _settle_replacements(p: Pass, d: Deployment) -> None:
    for r in _mine(p, d):
        if not r.replaces:
            continue
        old = p.work.get(r.replaces)
        if old is None:
            p.put(evolve(r, replaces=""))
        elif r.state == S.READY:
            p.put(evolve(r, replaces=""))
            p.retire(old, f"replaced by {r.id}, which is ready", d.drain_timeout)


def _still_wanted(p: Pass, new: Replica, old: Replica, new_hash: str) -> bool:
    """Whether `new` should go on replacing `old`: while `old` must move (a draining node,
    an unhealthy GPU), or while it runs an outdated spec and `new` found room (a rolling
    update's surge; one with no room goes down then up instead, which _roll does once
    this one is gone)."""
    if p.must_move(old):
        return True
    return p.hash(old.spec) != new_hash and new.placed


def _drop_unneeded_replacements(p: Pass, d: Deployment) -> None:
    new_hash = p.hash(d)
    for r in _mine(p, d):
        if not r.replaces or r.state == S.READY:
            continue
        old = p.work.get(r.replaces)
        if old is not None and not _still_wanted(p, r, old, new_hash):
            p.drop(r, f"{old.id} no longer needs replacing: stopped")
            if old.reason.startswith(DRAIN_STUCK):
                p.put(evolve(old, reason=""))


def _victim_order(p: Pass, r: Replica, new_hash: str) -> tuple[bool, bool, bool, float, int]:
    """Scale-down order: what serves least goes first. Pending before started, not ready
    before ready (a ready replica never stops while a not-ready one could go instead),
    outdated before current, then the newest."""
    return (r.placed, r.state == S.READY, p.hash(r.spec) == new_hash, -r.placed_at, -r.index)


def _scale(p: Pass, d: Deployment) -> None:
    mine = _mine(p, d)
    slots = [r for r in mine if not r.replaces]
    if len(slots) > d.replicas:
        new_hash = p.hash(d)
        victims = sorted(slots, key=lambda r: _victim_order(p, r, new_hash))
        by_target = {r.replaces: r for r in mine if r.replaces}
        for r in victims[: len(slots) - d.replicas]:
            p.retire(r, f"scaled down to {d.replicas}", d.drain_timeout)
            extra = by_target.get(r.id)
            if extra is not None:
                p.retire(extra, f"scaled down to {d.replicas}", d.drain_timeout)
    for _ in range(d.replicas - len(slots)):
        p.new_replica(d)


DRAIN_STUCK = "draining, with nowhere to move"


def _drain(p: Pass, d: Deployment) -> None:
    mine = _mine(p, d)
    replaced = {r.replaces: r for r in mine if r.replaces}
    if not replaced and not p.state.draining and not p.state.sick and not p.state.sick_hcas:
        return  # nothing drains or ails, nothing is being replaced: no replica to look at
    for r in mine:
        if r.id in replaced:
            new = replaced[r.id]
            stuck = f"{DRAIN_STUCK}: {new.reason}" if new.state == S.PENDING else ""
            if stuck != r.reason and (stuck or r.reason.startswith(DRAIN_STUCK)):
                p.put(evolve(r, reason=stuck))
            continue
        if r.replaces or not r.placed:
            continue
        why = p.must_move(r)
        if not why:
            continue
        if r.state != S.READY:  # serves nothing: move it now
            p.event(r, f"{why}: placing again")
            p.place(p.unplace(r), exclude=p.move_exclude(r))
            continue
        new = p.new_replica(d, replaces=r.id)
        p.event(r, f"{why}: {new.id} takes over once ready")
        if new.state == S.PENDING:
            p.put(evolve(r, reason=f"{DRAIN_STUCK}: {new.reason}"))


def _roll(p: Pass, d: Deployment) -> None:
    mine = _mine(p, d)
    if any(r.replaces for r in mine):
        return  # one replacement at a time
    new_hash = p.hash(d)
    current: list[Replica] = []
    outdated: list[Replica] = []
    for r in mine:
        (current if p.hash(r.spec) == new_hash else outdated).append(r)
    if not outdated or any(r.state != S.READY for r in current):
        return
    idle = [r for r in outdated if r.state != S.READY]
    if idle:  # not serving: update in place
        _recreate(p, idle[0], d, "spec changed; not serving, so updated in place")
        return
    old = outdated[0]
    new = p.new_replica(d, replaces=old.id)
    if new.placed:
        p.event(old, f"spec changed: {new.id} takes over once ready")
        return
    # No room to surge: one at a time, down then up. A ready one drains first; its slot
    # is taken at once by a replica of the new spec, which waits for the room it frees.
    p.drop(new, "no room to surge")
    why = "spec changed; no room to surge, so down then up"
    if d.drain_timeout <= 0:
        _recreate(p, old, d, why)  # nothing to wait for: in place, under its own id
        return
    p.retire(old, why, d.drain_timeout)
    p.new_replica(d)


def _recreate(p: Pass, r: Replica, d: Deployment, why: str) -> None:
    p.event(r, why)
    fresh = evolve(p.unplace(r), spec=d, restarts=0, backoff_until=0.0, last_log_tail=())
    p.place(p.put(fresh))

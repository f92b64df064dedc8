"""Per-deployment steps of a reconcile pass: replacements, scaling, drain, rolling update.

Slots are the replicas that count towards `replicas`; a replacement (`replaces` set) is a
surge replica that takes over its slot once ready: the old one stops only then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attrs import evolve

from llmgw.model.deployment import Deployment, Replica, ReplicaState

if TYPE_CHECKING:
    from .reconcile import Pass

S = ReplicaState


def roll_deployment(p: Pass, d: Deployment) -> None:
    _settle_replacements(p, d)
    _scale(p, d)
    _drain(p, d)
    _roll(p, d)


def _mine(p: Pass, d: Deployment) -> list[Replica]:
    return sorted((r for r in p.work.values() if r.deployment == d.name), key=lambda r: r.index)


def _settle_replacements(p: Pass, d: Deployment) -> None:
    for r in _mine(p, d):
        if not r.replaces:
            continue
        old = p.work.get(r.replaces)
        if old is None:
            p.put(evolve(r, replaces=""))
        elif r.state == S.READY:
            p.drop(old, f"replaced by {r.id}, which is ready: stopped")
            p.put(evolve(r, replaces=""))


def _victim_order(r: Replica, new_hash: str) -> tuple[bool, bool, bool, int]:
    """Scale-down order: unplaced first, then not ready, then outdated, then highest index."""
    return (r.placed, r.state == S.READY, r.spec.template_hash() == new_hash, -r.index)


def _scale(p: Pass, d: Deployment) -> None:
    mine = _mine(p, d)
    slots = [r for r in mine if not r.replaces]
    if len(slots) > d.replicas:
        new_hash = d.template_hash()
        victims = sorted(slots, key=lambda r: _victim_order(r, new_hash))
        by_target = {r.replaces: r for r in mine if r.replaces}
        for r in victims[: len(slots) - d.replicas]:
            p.drop(r, f"scaled down to {d.replicas}: stopped")
            extra = by_target.get(r.id)
            if extra is not None:
                p.drop(extra, f"scaled down to {d.replicas}: stopped")
    for _ in range(d.replicas - len(slots)):
        p.new_replica(d)


def _drain(p: Pass, d: Deployment) -> None:
    mine = _mine(p, d)
    replaced = {r.replaces for r in mine if r.replaces}
    for r in mine:
        if r.replaces or r.id in replaced or not r.placed:
            continue
        draining = [m.node_id for m in r.members if p.draining(m.node_id)]
        if not draining:
            continue
        if r.state != S.READY:  # serves nothing: move it now
            p.event(r, f"node {draining[0]} draining: placing again")
            p.place(p.unplace(r), exclude=frozenset(draining))
            continue
        new = p.new_replica(d, replaces=r.id)
        p.event(r, f"node {draining[0]} draining: {new.id} takes over once ready")


def _roll(p: Pass, d: Deployment) -> None:
    mine = _mine(p, d)
    if any(r.replaces for r in mine):
        return  # one replacement at a time
    new_hash = d.template_hash()
    current = [r for r in mine if r.spec.template_hash() == new_hash]
    outdated = [r for r in mine if r.spec.template_hash() != new_hash]
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
    # No room to surge: one at a time, down then up.
    p.drop(new, "no room to surge")
    _recreate(p, old, d, "spec changed; no room to surge, so down then up")


def _recreate(p: Pass, r: Replica, d: Deployment, why: str) -> None:
    p.event(r, why)
    fresh = evolve(
        p.unplace(r),
        spec=d,
        restarts=0,
        backoff_until=0.0,
        last_log_tail=(),
        state=S.PENDING,
    )
    p.place(p.put(fresh))

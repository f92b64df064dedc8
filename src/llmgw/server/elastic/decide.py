"""The autoscaler's decision (elastic deployments), pure: load samples in, a replica count and its
reason out. No clock, no sockets: the server feeds it the routers' summed reports.

The rules, for a deployment with `autoscale` (model/autoscale.py):

- A sample's need is the replicas its load asks for: in flight / target, rounded up (the
  load does not depend on how many replicas serve it, so new replicas that are still
  starting cause no second step). For `waiting_per_replica` the engines' queue says only
  "too few" (waiting / target, rounded up, when above the count) or, empty, "maybe too
  many": one fewer.
- Up: when every sample of the last `scale_up_after` needs more than the count, to the
  least of those needs (the window is the guard against a spike), never above `max`.
- Down: when every sample of the last `scale_down_after` needs fewer, and the last change
  is that long ago too, to the greatest of those needs, at most halving per step (the
  maximum step: load that fell away may come back), never below `min` (nor below one
  while requests come).
- Zero (`min: 0` with `idle_to_zero`): after `idle_to_zero` without a request, nothing in
  flight and nothing waiting. From zero, any request (a router holds it) wakes the
  deployment at once: to max(1, its need), no window.

A window counts only once the samples cover it (the first samples after a start, or after
the server took over, decide nothing until then).
"""

from __future__ import annotations

import math

from attrs import evolve, frozen

from llmgw.model.autoscale import Autoscale, Target


@frozen
class LoadSample:
    """One report interval's load of a deployment, summed over the routers."""

    at: float
    in_flight: float = 0.0  # requests sent to an engine and not answered (and held ones)
    waiting: float = 0.0  # requests the engines hold in their own queues
    requests: int = 0  # requests that arrived in the interval (held ones included)

    @property
    def active(self) -> bool:
        return bool(self.requests or self.in_flight or self.waiting)


@frozen
class ScaleMemory:
    """What the decision remembers of one deployment between calls."""

    samples: tuple[LoadSample, ...] = ()
    last_change: float = -math.inf
    last_active: float | None = None  # the last sample with a request; None: none seen


@frozen
class Decision:
    replicas: int
    reason: str  # "" when the count stays
    memory: ScaleMemory


def observe(spec: Autoscale, memory: ScaleMemory, sample: LoadSample) -> ScaleMemory:
    """`memory` with `sample` added; samples older than every window are dropped (one
    older than the longest window is kept: it shows that the window is covered)."""
    horizon = sample.at - max(spec.scale_up_after, spec.scale_down_after, spec.idle_to_zero)
    kept = [s for s in memory.samples if s.at <= sample.at]
    while len(kept) > 1 and kept[1].at <= horizon:
        kept.pop(0)
    # Idle time counts from the last request, or from the first sample when none came.
    last_active = sample.at if sample.active or memory.last_active is None else memory.last_active
    return evolve(memory, samples=(*kept, sample), last_active=last_active)


def _need(spec: Autoscale, s: LoadSample, current: int) -> int:
    if spec.target == Target.IN_FLIGHT:
        return math.ceil(s.in_flight / spec.target_value - 1e-9)
    if s.waiting > 0:
        return max(current, math.ceil(s.waiting / spec.target_value - 1e-9))
    return current - 1


def _window(memory: ScaleMemory, now: float, length: float) -> list[LoadSample] | None:
    """The samples of the last `length` seconds, or None while the samples do not cover it."""
    if not memory.samples or memory.samples[0].at > now - length:
        return None
    return [s for s in memory.samples if s.at >= now - length] or None


def _figure(spec: Autoscale, samples: list[LoadSample]) -> str:
    if spec.target == Target.IN_FLIGHT:
        lo, hi = min(s.in_flight for s in samples), max(s.in_flight for s in samples)
        what = "in flight"
    else:
        lo, hi = min(s.waiting for s in samples), max(s.waiting for s in samples)
        what = "waiting"
    span = f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"
    return f"{what} {span} (target {spec.target_value:g} per replica)"


def decide(spec: Autoscale, current: int, memory: ScaleMemory, now: float) -> Decision:
    """The count `current` should become now, and why (the figures that caused it)."""
    latest = memory.samples[-1] if memory.samples else None
    if current == 0:
        if latest is not None and latest.active:
            n = min(spec.max, max(1, spec.min, _need(spec, latest, 0)))
            return _change(memory, now, n, f"woken from zero by requests: {_figure(spec, [latest])}")
        if spec.min > 0:
            return _change(memory, now, spec.min, f"below min: up to {spec.min}")
        return Decision(0, "", memory)
    if current < spec.min or current > spec.max:
        n = min(max(current, spec.min), spec.max)
        return _change(memory, now, n, f"outside min..max ({spec.min}..{spec.max}): to {n}")
    if spec.idle_to_zero and memory.last_active is not None and latest is not None:
        idle = now - memory.last_active
        if idle >= spec.idle_to_zero and not latest.active:
            return _change(memory, now, 0, f"no request for {idle:g}s (idle_to_zero "
                                           f"{spec.idle_to_zero:g}s): to zero")
    up = _window(memory, now, spec.scale_up_after)
    if up is not None and current < spec.max:
        need = min(_need(spec, s, current) for s in up)
        if need > current:
            n = min(spec.max, need)
            return _change(memory, now, n, f"scaled up {current} -> {n}: {_figure(spec, up)} "
                                           f"for {spec.scale_up_after:g}s")
    floor = max(spec.min, 1)
    down = _window(memory, now, spec.scale_down_after)
    if down is not None and current > floor and now - memory.last_change >= spec.scale_down_after:
        need = max(_need(spec, s, current) for s in down)
        if need < current:
            n = max(floor, need, math.ceil(current / 2))
            return _change(memory, now, n, f"scaled down {current} -> {n}: {_figure(spec, down)} "
                                           f"for {spec.scale_down_after:g}s")
    return Decision(current, "", memory)


def _change(memory: ScaleMemory, now: float, n: int, reason: str) -> Decision:
    return Decision(n, reason, evolve(memory, last_change=now))

"""The autoscaler's loop (elastic deployments): the routers' load reports in, replica counts out.

Twice per interval (the shortest `load_report_interval` the live routers report at; 5 s
while none does; twice, so that a load step waits at most half an interval after the
router's report, not a whole one) each deployment with `autoscale` gets the routers'
summed sample (load_board.py), observe() and decide() (autoscale.py, pure), and a count
that changed is set through Orchestrator.autoscale_to, the path `ctl scale` takes:
persisted, an event in describe with decide()'s reason, the reconciler drains what goes. A router
that holds requests for a deployment at zero says so at once (a wake): that deployment
is decided then, not at the next interval.

While no router reports at all, nothing is decided: the server does not know the load
(routers cut off from it may still be serving), so it does not scale down on silence.
ScaleMemory is in memory only: a new leader starts empty and its windows wait to be
covered, which decide() already does.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping

import trio
from attrs import evolve, frozen

from llmgw.model.deployment import Deployment, Replica
from llmgw.server.elastic.decide import LoadSample, ScaleMemory, decide, observe
from llmgw.server.elastic.load_board import LoadBoard
from llmgw.server.placement.preempt import Preemption, choose, placed_counts
from llmgw.transport.requests import LoadReportOp

log = logging.getLogger(__name__)

# A deployment that took GPUs waits this long, at most, for one more of its replicas to be
# placed before it may take again (GPUs freed by a drain may take a while to come back).
PREEMPT_RETRY = 60.0
DEFAULT_INTERVAL = 5.0  # seconds: the report interval assumed while no router says its own
TICKS_PER_INTERVAL = 2


@frozen
class Change:
    deployment: str
    before: int
    after: int
    reason: str
    also: tuple[str, str] | None = None  # (deployment, event): a preemption's taker
    asleep: bool = False  # the deployment's `asleep` after it (sleep_when_idle: sleeping.py)

    @property
    def direction(self) -> str:
        if self.after == self.before:
            return "wake" if not self.asleep else "sleep"
        return "up" if self.after > self.before else "down"


def served_names(deployments: Mapping[str, Deployment]) -> dict[str, str]:
    """Served name (and each LoRA adapter's name) -> its deployment."""
    out: dict[str, str] = {}
    for name, d in deployments.items():
        for a in d.adapters:
            out.setdefault(a.name, name)
        out[d.served_name] = name
    return out


def _sleep_instead(d: Deployment, n: int, reason: str, active: bool) -> tuple[bool, Change | None]:
    """sleep_when_idle: where decide() would go to zero the count stays and the engines
    sleep (sleeping.py); requests, or any other change of count, wake them. (True, the
    change or None) where this rule decides; (False, None) where decide()'s count does."""
    spec = d.autoscale
    if spec is None or not spec.sleep_when_idle or d.replicas == 0:
        return False, None
    if n == 0:  # asleep already: it stays so, at its count
        return True, None if d.asleep else Change(
            d.name, d.replicas, d.replicas,
            reason.replace(": to zero", ": asleep (sleep_when_idle)"), asleep=True)
    if d.asleep and (active or n != d.replicas):
        why = "woken from sleep by requests" if active else "woken from sleep"
        return True, Change(d.name, d.replicas, n, f"{why}{': ' + reason if reason else ''}")
    return False, None


class Autoscaler:
    def __init__(self) -> None:
        self.board = LoadBoard()
        self.memory: dict[str, ScaleMemory] = {}
        self.decisions: Counter[tuple[str, str]] = Counter()  # (deployment, up|down) -> count
        self.desired: dict[str, int] = {}  # the last count decided per autoscaled deployment
        self.last: dict[str, LoadSample] = {}  # the last sample per deployment (describe)
        self.preemptions = 0
        self._taken: dict[str, tuple[float, int]] = {}  # taker -> (when, its placed count then)
        self._poke = trio.Event()
        self._wake: set[str] = set()

    # ---- from the routers ----

    def report(self, router: str, now: float, op: LoadReportOp,
               deployments: Mapping[str, Deployment]) -> None:
        self.board.put(router, now, op.interval, op.models)
        if not op.wake:
            return
        names = served_names(deployments)
        for served, load in op.models.items():
            d = deployments.get(names.get(served, ""))
            if d is not None and d.autoscale is not None and (d.replicas == 0 or d.asleep) and (
                    load.held or load.requests or load.in_flight):
                self._wake.add(d.name)
        if self._wake:
            self._poke.set()

    # ---- the decision, without I/O ----

    def step(self, now: float, deployments: Mapping[str, Deployment],
             only: set[str] | None = None) -> list[Change]:
        """observe() and decide() for each autoscaled deployment (or those in `only`);
        the counts that change. Nothing while no router reports."""
        auto = {name for name, d in deployments.items() if d.autoscale is not None}
        for gone in (set(self.memory) | set(self.desired)) - auto:  # deleted, or pinned
            self.memory.pop(gone, None)
            self.desired.pop(gone, None)
            self.last.pop(gone, None)
        samples = self.board.samples(now, served_names(deployments))
        if not self.board.reports:
            return []
        changes: list[Change] = []
        for name, d in sorted(deployments.items()):
            spec = d.autoscale
            if spec is None or (only is not None and name not in only):
                continue
            sample = samples.get(name, LoadSample(at=now))
            self.last[name] = sample
            memory = self.memory.get(name, ScaleMemory())
            if self.desired.get(name, d.replicas) != d.replicas:
                # Set from outside (ctl scale --pin, then an apply): a change like ours, so
                # the cool-down before a step down counts from now.
                memory = evolve(memory, last_change=now)
            memory = observe(spec, memory, sample)
            decision = decide(spec, d.replicas, memory, now)
            self.memory[name] = decision.memory
            handled, change = _sleep_instead(d, decision.replicas, decision.reason, sample.active)
            if not handled and decision.replicas != d.replicas:
                change = Change(name, d.replicas, decision.replicas, decision.reason)
            self.desired[name] = d.replicas if change is None else change.after
            if change is not None:
                changes.append(change)
        return changes

    def preemption(self, now: float, deployments: Mapping[str, Deployment],
                   replicas: Mapping[str, Replica], pending: Mapping[str, str]) -> Change | None:
        """At most one step down of a lower-priority deployment for one that cannot place
        a replica for lack of GPUs (preempt.py); the taker's event rides along."""
        placed = placed_counts(replicas)
        self._taken = {t: v for t, v in self._taken.items()
                       if placed.get(t, 0) <= v[1] and now - v[0] < PREEMPT_RETRY}
        p: Preemption | None = choose(deployments, replicas, pending, frozenset(self._taken))
        if p is None:
            return None
        self._taken[p.taker] = (now, placed.get(p.taker, 0))
        # Our change, as a decision's is: the victim's cool-down counts from now.
        if p.victim in self.memory:
            self.memory[p.victim] = evolve(self.memory[p.victim], last_change=now)
        self.desired[p.victim] = p.victim_after
        return Change(p.victim, p.victim_before, p.victim_after, p.victim_reason,
                      also=(p.taker, p.taker_reason))

    # ---- the loop ----

    def tick(self) -> float:
        return self.board.interval(DEFAULT_INTERVAL) / TICKS_PER_INTERVAL

    async def serve(self, deployments: Callable[[], Mapping[str, Deployment]],
                    apply: Callable[[Change, float], Awaitable[bool]],
                    clock: Callable[[], float],
                    cluster: Callable[[], tuple[Mapping[str, Replica], Mapping[str, str]]] | None = None,
                    *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Decide every interval (or at once on a wake) and `apply` each change (True:
        it was set; False: the deployment changed meanwhile, e.g. pinned or deleted)."""
        task_status.started()
        next_at = trio.current_time() + self.tick()
        while True:
            with trio.move_on_at(next_at):
                await self._poke.wait()
            self._poke = trio.Event()
            woken, self._wake = self._wake, set()
            due = trio.current_time() >= next_at
            if due:
                next_at = trio.current_time() + self.tick()
            try:
                changes = self.step(clock(), deployments(), None if due else woken)
                if due and cluster is not None:
                    taken = self.preemption(clock(), deployments(), *cluster())
                    changes += [taken] if taken is not None else []
            except Exception:
                # A bug in a decision costs this round, not the server's loop.
                log.exception("autoscale decision failed; trying again next interval")
                continue
            for c in changes:
                try:
                    done = await apply(c, clock())
                except Exception:
                    log.exception("autoscale: could not set %s to %d replicas", c.deployment, c.after)
                    continue
                if done:
                    self.decisions[(c.deployment, c.direction)] += 1
                    self.preemptions += c.also is not None
                    log.info("autoscale %s: %s", c.deployment, c.reason)

"""The engine supervisor: converges on the desired set, watches engines, adopts orphans.

One nursery per engine holds its exit watcher, its health checker and its stopper; one
engine's failure never reaches another. Cancelling `serve` (the agent stopping) leaves
every engine running in its own session: only `apply` without a spec stops one.

Its parts, each in its own module: the start pipeline (start.py), GPU release tracking
(releases.py), the health watcher (health_watch.py), in-place changes (inplace.py), and
the lifecycle's rules (states.EngineLifecycle: failure => stop, the exit's reason and
whether the server hears of it).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

import trio
from attrs import evolve

from llmgw.agent.discovery.engine_check import command_keys
from llmgw.agent.discovery.procnet import PortConflict
from llmgw.agent.engines import weights_for
from llmgw.agent.gpus.memory import GpuMemoryReader
from llmgw.agent.kvevents.feeds import KvFeeds
from llmgw.agent.lifecycle import inplace
from llmgw.agent.lifecycle.adopt import Adopted, Gone, adopt_records
from llmgw.agent.lifecycle.converge import Start, Stop, converge
from llmgw.agent.lifecycle.download_progress import repo_dir
from llmgw.agent.lifecycle.engine import Engine
from llmgw.agent.lifecycle.health import http_health
from llmgw.agent.lifecycle.health_watch import HealthProbe, HealthWatch
from llmgw.agent.lifecycle.logtail import tail_lines
from llmgw.agent.lifecycle.preflight_report import RUNNING as PREFLIGHT_RUNNING
from llmgw.agent.lifecycle.preflight_report import result_path as preflight_path
from llmgw.agent.lifecycle.records import LOG, EngineRecord, engine_dir, remove_record
from llmgw.agent.lifecycle.releases import GpuReleases
from llmgw.agent.lifecycle.start import Refused, Starter, note
from llmgw.agent.lifecycle.states import EngineEvent, Phase, next_state, reported
from llmgw.agent.lifecycle.watch import Watching
from llmgw.agent.process import procs
from llmgw.agent.process.spawn import InventoryFn, PlanFn, StorageFn, default_plan
from llmgw.config.agent import AgentConfig
from llmgw.errors import LlmgwError
from llmgw.model.engine import EngineReport, EngineSpec, EngineState
from llmgw.model.inventory import ModelCopy

log = logging.getLogger(__name__)

# Seconds an agent start waits for adopted engines' first health check before Hello.
ADOPTION_HEALTH_WAIT = 2.0


class Supervisor(Watching):
    def __init__(
        self,
        config: AgentConfig,
        on_report: Callable[[EngineReport], None],
        *,
        python: str = sys.executable,
        plan: PlanFn | None = None,
        on_unavailable: Callable[[], None] | None = None,
        gpu_memory: GpuMemoryReader | None = None,
        model_size: Callable[[str], int] | None = None,
        on_gpus_changed: Callable[[], None] | None = None,
        storage: StorageFn | None = None,
        inventory: InventoryFn | None = None,
        on_bad_copy: Callable[[ModelCopy, str], None] | None = None,
        health_probe: HealthProbe = http_health,
        kv: KvFeeds | None = None,
    ) -> None:
        self._config = config
        # The KV-event receivers of the engines that publish them (kv_events), each from
        # before its engine spawns (or from its adoption) to its exit; None: none received.
        self._kv = kv
        # Called (on the event loop, must not block) with a copy of weights an engine
        # died reading, and the engine's words (llmgw.agent.lifecycle.bad_copies).
        self._on_bad_copy = on_bad_copy
        # This node's last storage scan: the default plan starts engines on the copy it
        # found (or downloads into download_dir), and the record says which. Only with the
        # default plan: what a plan given here loads is its own business.
        self._storage = storage if plan is None else None
        # Called (on the event loop, must not block) when releasing() or engine_pids()
        # changes: an engine spawned, a session ended, a GPU released or its reason moved.
        self._on_gpus_changed = on_gpus_changed
        self._sup = config.supervisor
        self.releases = GpuReleases(gpu_memory, timeout=self._sup.release_timeout,
                                    on_change=self._gpus_changed)
        # Called when an engine's command does not resolve: the agent runs discovery
        # again, so that its inventory says so.
        self._on_unavailable = on_unavailable
        self._on_report = on_report
        self._plan: PlanFn = plan or default_plan(config, python, storage, inventory)
        self._starter = Starter(config, self._plan, command_keys(config, python),
                                self._storage, self.releases)
        self.health = HealthWatch(config.mgmt_addr, self._sup, on_event=self._event,
                                  on_conflict=self._conflict,
                                  on_report=lambda eng: self._call(eng.report),
                                  on_probe=lambda seconds, ok: self.on_probe(seconds, ok),
                                  model_size=model_size, download_repo=self._download_repo,
                                  probe=health_probe)
        self._engines: dict[str, Engine] = {}
        self._exited: dict[str, EngineReport] = {}
        self._nursery: trio.Nursery | None = None
        self._lock = trio.Lock()
        # For the metrics: engines spawned, those of them that ran here before (restarts),
        # and each health probe's duration and answer.
        self.starts_total = 0
        self.restarts_total = 0
        self.on_probe: Callable[[float, bool], None] = lambda seconds, ok: None

    # ---- public API ----

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Adopt recorded engines, then host engine nurseries until cancelled."""
        found = await adopt_records(self._sup.work_dir)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                for item in found:
                    if isinstance(item, Adopted):
                        if self._kv is not None:
                            await self._kv.begin(nursery, item.record.spec)
                        self._launch_watch(item.record, "adopted after agent restart")
                    else:
                        self._report_gone(item)
                await self._first_health(ADOPTION_HEALTH_WAIT)
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._nursery = None

    async def _first_health(self, bound: float) -> None:
        """Give adopted engines one health check before anyone asks for reports(): the
        Hello that follows should say "ready" for an engine that was serving all along,
        not "starting", which would take it out of the routers' tables for a moment."""
        with trio.move_on_after(bound):
            for eng in list(self._engines.values()):
                if eng.health:
                    await eng.settled.wait()

    def reports(self) -> tuple[EngineReport, ...]:
        """What a Hello carries: each live engine's report with the spec it runs (a server
        that lost its state rebuilds from them), and the latest of those that exited."""
        live = [evolve(e.report, spec=e.spec) for e in self._engines.values()]
        return tuple(sorted([*live, *self._exited.values()], key=lambda r: r.replica_id))

    async def apply(self, desired: tuple[EngineSpec, ...]) -> None:
        """Converge on `desired`: start what is missing, stop what is not wanted."""
        async with self._lock:
            running = {rid: e.spec.generation for rid, e in self._engines.items()}
            exited = {rid: r.generation for rid, r in self._exited.items()}
            actions = converge(desired, running, exited)
            inplace.new_adapters(self._engines, desired, self._sup.work_dir)
            inplace.new_sleep(self._engines, desired, self._sup.work_dir, self._follow_sleep)
            wanted = {s.replica_id for s in desired}
            for rid in [r for r in self._exited if r not in wanted]:
                del self._exited[rid]
            stops = [a for a in actions if isinstance(a, Stop)]
            async with trio.open_nursery() as nursery:
                for stop in stops:
                    nursery.start_soon(self._stop, stop)
            for action in actions:
                if isinstance(action, Start):
                    await self._start(action.spec)

    def releasing(self) -> dict[str, str]:
        """GPU UUID -> why it is not back yet, for each GPU of an ended engine whose
        memory has not come back (Gpu.releasing in the inventory)."""
        return self.releases.releasing()

    def engine_pids(self) -> frozenset[int]:
        """Every process of every live engine session, and those of ended sessions still
        alive while their GPUs release: on the GPUs, none of them is foreign. Blocking (one
        walk of /proc): call it from a thread."""
        sids = frozenset(e.record.sid for e in self._engines.values() if e.record.sid > 0)
        found = procs.sessions_pids(sids)
        out = {pid for pids in found.values() for pid in pids}
        out.update(e.record.pid for e in self._engines.values() if e.record.pid > 0)
        for e in self._engines.values():
            out.update(e.pids)
        out.update(self.releases.alive())
        return frozenset(out)

    def log_tail(self, replica_id: str, lines: int) -> tuple[str, ...]:
        try:
            path = os.path.join(engine_dir(self._sup.work_dir, replica_id), LOG)
        except ValueError:
            return ()
        return tail_lines(path, lines)

    # ---- internals ----

    def _follow_sleep(self, eng: Engine) -> None:
        inplace.follow_sleep(self._nursery_or_raise(), self._engines, eng, self._config.mgmt_addr)

    def _event(self, eng: Engine, event: EngineEvent, reason: str,
               **changes: object) -> None:
        """Move `eng` through its lifecycle; report when its phase changed, with `reason`
        (the table holds none: the caller knows the pid, the code, the timeout). An event
        that fails it asks its stop (the lifecycle's rule), with `reason` as its failure."""
        move = eng.life.handle(event, reason)
        if move.stop:
            eng.stop_requested.set()
        phase = move.now
        if phase is not Phase.STARTING:
            eng.settled.set()
        if phase is Phase.READY and eng.adapters is not None:
            eng.adapters.poke()  # a fresh or restarted engine has none of them yet
        if phase is Phase.READY and move.was is not Phase.READY and eng.spec.asleep:
            self._follow_sleep(eng)  # started (or adopted) while its deployment sleeps
        if not move.changed:
            return  # a no-op pair of the table: nothing to report
        state = reported(phase)
        eng.report = evolve(eng.report, state=state, reason=reason, **changes)  # type: ignore[arg-type]
        log.info("engine %s gen %d: %s (%s)", eng.spec.replica_id, eng.spec.generation,
                 state, reason)
        self._call(eng.report)

    def _gpus_changed(self) -> None:
        if self._on_gpus_changed is None:
            return
        try:
            self._on_gpus_changed()
        except Exception:
            log.exception("on_gpus_changed failed")

    def _call(self, report: EngineReport) -> None:
        try:
            self._on_report(report)
        except Exception:
            log.exception("on_report failed for %s", report.replica_id)

    def _nursery_or_raise(self) -> trio.Nursery:
        if self._nursery is None:
            raise RuntimeError("Supervisor.serve is not running")
        return self._nursery

    def _endpoint(self, spec: EngineSpec, health: bool) -> str:
        return f"http://{self._config.mgmt_addr}:{spec.port}" if health else ""

    @staticmethod
    def _key(record: EngineRecord, health: bool) -> str:
        """The key the report carries for the routers: only with an endpoint to use it on."""
        return record.api_key if health else ""

    async def _start(self, spec: EngineSpec) -> None:
        nursery = self._nursery_or_raise()
        rid = spec.replica_id
        prev = self._exited.pop(rid, None)
        restarts = prev.restarts + 1 if prev and prev.generation == spec.generation else 0
        folder = engine_dir(self._sup.work_dir, rid)
        os.makedirs(folder, exist_ok=True)
        log_path = os.path.join(folder, LOG)
        procs.rotate_log(log_path, self._sup.log_max_bytes)
        if self._kv is not None:
            # Bound before the spawn: the publisher's first batches find the port open.
            await self._kv.begin(nursery, spec)
        got = await self._starter.start(spec, restarts, folder, log_path)
        if isinstance(got, Refused):
            if self._kv is not None:
                self._kv.end(rid)
            self._refuse(spec, restarts, log_path, got.reason,
                         conflict_port=got.conflict_port, logged=got.logged)
            if got.unavailable and self._on_unavailable is not None:
                self._on_unavailable()
            return
        record, health, pid = got.record, got.plan.health_checked, got.record.pid
        eng = Engine(record=record, health=health,
                     report=EngineReport(rid, spec.generation, EngineState.STARTING,
                                         endpoint=self._endpoint(spec, health),
                                         api_key=self._key(record, health),
                                         pid=pid, restarts=restarts, weights=got.weights,
                                         preflight=PREFLIGHT_RUNNING if got.preflight_path else ""),
                     preflight_path=got.preflight_path)
        eng.pids.add(pid)
        self._engines[rid] = eng
        self.starts_total += 1
        self.restarts_total += prev is not None
        self._event(eng, EngineEvent.STARTED, f"started (pid {pid})")
        self._gpus_changed()
        nursery.start_soon(self._run, eng)

    def _refuse(self, spec: EngineSpec, restarts: int, log_path: str, reason: str, *,
                conflict_port: int = 0, logged: bool = False) -> None:
        """Report `spec` as exited without a process: it was not (or could not be) started.
        The reason goes to the engine's log too, for `ctl logs`."""
        rid = spec.replica_id
        if not logged:
            log.warning("engine %s gen %d: %s", rid, spec.generation, reason)
        note(log_path, rid, reason)
        report = EngineReport(rid, spec.generation, reported(next_state(None, EngineEvent.EXITED)),
                              reason=reason, restarts=restarts, conflict_port=conflict_port,
                              log_tail=tail_lines(log_path, self._sup.log_lines))
        self._exited[rid] = report
        self._call(report)

    def _conflict(self, eng: Engine, conflict: PortConflict) -> None:
        """Another process answers on `eng`'s port: never ready; failed, so stopped (the
        lifecycle's rule), saying who."""
        self._event(eng, EngineEvent.PORT_CONFLICT, conflict.reason, conflict_port=conflict.port)

    def _launch_watch(self, record: EngineRecord, reason: str) -> None:
        nursery = self._nursery_or_raise()
        spec = record.spec
        # Only whether it is health-checked is asked of the plan here: the recorded indices
        # where the record has them, else positions (an older record), which cannot change
        # that answer.
        indices = (dict(zip(spec.gpus, record.cuda_devices, strict=True))
                   if len(record.cuda_devices) == len(spec.gpus)
                   else {u: i for i, u in enumerate(spec.gpus)})
        try:
            health = self._plan(spec, indices).health_checked
        except Exception as exc:  # the config changed under a running engine: still adopt
            log.warning("engine %s: no launch plan (%s); watched for liveness only",
                        spec.replica_id, exc)
            health = False
        eng = Engine(record=record, health=health,
                     report=EngineReport(spec.replica_id, spec.generation, EngineState.STARTING,
                                         endpoint=self._endpoint(spec, health),
                                         api_key=self._key(record, health),
                                         pid=record.pid, restarts=record.restarts,
                                         weights=record.weights),
                     preflight_path=preflight_path(engine_dir(self._sup.work_dir, spec.replica_id),
                                                   spec))
        if eng.preflight_path:
            eng.report = evolve(eng.report, preflight=PREFLIGHT_RUNNING)
            self._note_preflight(eng, report=False)  # the event below reports it
        eng.pids.add(record.pid)
        self._engines[spec.replica_id] = eng
        self._event(eng, EngineEvent.ADOPTED, reason)
        nursery.start_soon(self._run, eng)

    def _report_gone(self, gone: Gone) -> None:
        rec = gone.record
        state = reported(next_state(None, EngineEvent.EXITED))
        report = EngineReport(rec.spec.replica_id, rec.spec.generation, state,
                              pid=rec.pid, reason=gone.reason, restarts=rec.restarts,
                              log_tail=tail_lines(rec.log_path, self._sup.log_lines))
        self._exited[rec.spec.replica_id] = report
        remove_record(self._sup.work_dir, rec.spec.replica_id)
        self._call(report)

    async def _stop(self, stop: Stop) -> None:
        eng = self._engines.get(stop.replica_id)
        if eng is None:
            return
        eng.ask_stop(stop.reason)
        await eng.done.wait()

    def _download_repo(self, spec: EngineSpec) -> str:
        """The HF cache folder the engine downloads `spec`'s weights into; "" when it loads
        a copy (or a custom plan, with no scan to say)."""
        if self._storage is None:
            return ""
        try:
            weights = weights_for(spec, self._config, self._storage())
        except LlmgwError as exc:  # the start already said why; no progress to show
            log.debug("engine %s: no download to watch: %s", spec.replica_id, exc)
            return ""
        return repo_dir(weights.download_dir, spec.model) if weights.download_dir else ""

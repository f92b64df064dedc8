"""The engine supervisor: converges on the desired set, watches engines, adopts orphans.

One nursery per engine holds its exit watcher, its health checker and its stopper; one
engine's failure never reaches another. Cancelling `serve` (the agent stopping) leaves
every engine running in its own session: only `apply` without a spec stops one.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Awaitable, Callable, Mapping

import trio
from attrs import define, evolve, field

from llmgw.agent.discovery.engine_check import command_keys, missing_command
from llmgw.agent.discovery.procnet import PortConflict
from llmgw.agent.engines import LaunchPlan, weights_for
from llmgw.agent.gpus.claims import check_gpus
from llmgw.agent.gpus.memory import GpuMemory, GpuMemoryReader
from llmgw.agent.gpus.release import release_reasons
from llmgw.agent.lifecycle import sleep as engine_sleep
from llmgw.agent.lifecycle.adopt import Adopted, Gone, adopt_records
from llmgw.agent.lifecycle.bad_copies import unreadable_reason
from llmgw.agent.lifecycle.converge import Start, Stop, converge
from llmgw.agent.lifecycle.download_progress import DownloadProgress, downloaded, read_listing, repo_dir
from llmgw.agent.lifecycle.health import HealthEvent, http_health, probe_timeout, watch_health
from llmgw.agent.lifecycle.inflight import changed as inflight_changed
from llmgw.agent.lifecycle.inflight import read_in_flight
from llmgw.agent.lifecycle.logtail import tail_lines
from llmgw.agent.lifecycle.preflight_report import RUNNING as PREFLIGHT_RUNNING
from llmgw.agent.lifecycle.preflight_report import read_result as read_preflight
from llmgw.agent.lifecycle.preflight_report import result_path as preflight_path
from llmgw.agent.lifecycle.records import LOG, EngineRecord, engine_dir, new_key, remove_record, write_record
from llmgw.agent.lifecycle.startup_deadline import TAIL_MAX, StartupDeadline
from llmgw.agent.lifecycle.states import FAILING, EngineEvent, Phase, next_state, reported
from llmgw.agent.lora.adapters import SyncResult
from llmgw.agent.lora.sync import AdapterKeeper
from llmgw.agent.process import ports, procs
from llmgw.agent.process.spawn import InventoryFn, PlanFn, StorageFn, default_plan, spawn_plan
from llmgw.config.agent import AgentConfig
from llmgw.errors import LlmgwError
from llmgw.model.engine import RUNTIME_ADAPTERS, Adapter, EngineReport, EngineSpec, EngineState
from llmgw.model.inventory import ModelCopy

log = logging.getLogger(__name__)

# Seconds an agent start waits for adopted engines' first health check before Hello.
ADOPTION_HEALTH_WAIT = 2.0
# Once ready, whether the socket answering health is the engine's own is checked again
# every this many successful probes (a /proc walk; every probe would be wasteful).
OWNER_CHECK_EVERY = 30
# Seconds between readings of a stopped engine's GPUs while their memory comes back.
RELEASE_POLL = 1.0
# A start that finds one of its GPUs still releasing (the replica's previous session has
# just ended: a rolling restart on the same GPUs) reads again for this long before it is
# refused; the driver frees a process's memory a moment after the process is gone.
START_RELEASE_WAIT = 3.0
START_RELEASE_POLL = 0.25
# Seconds between reports of a download's bytes on disk (each a message to the server):
# often enough that `describe` moves, seldom enough to cost nothing at a hundred engines.
DOWNLOAD_REPORT_EVERY = 5.0
# Seconds between looks for the pre-flight's result while the launcher runs the probe: a
# stat of one file; the server hears of the result within this of it being written.
PREFLIGHT_POLL = 0.5

Reading = Mapping[str, GpuMemory]


@define(eq=False)
class _Release:
    """The GPUs of one ended engine session, until their memory is back."""

    replica_id: str
    gpus: tuple[str, ...]
    pids: frozenset[int]  # the session's processes, the leader included
    began: float  # trio's clock when the session ended
    reasons: dict[str, str]  # uuid -> why it is still releasing; empty: released
    alive: frozenset[int] = frozenset()  # of `pids`, those /proc still had last time
    late: bool = False  # past release_timeout (logged once)
    # uuid -> MiB free right before the engine was spawned: its memory is back once free
    # is that again (an idle board's own reservation is no leftover). Absent (an adopted
    # engine): judged against the total alone.
    free_before: Mapping[str, int] = field(factory=dict)


async def watch_release(
    rel: _Release,
    read: Callable[[], Awaitable[Reading | None]],
    states: Callable[[frozenset[int]], Awaitable[dict[int, str | None]]],
    *,
    timeout: float,
    on_change: Callable[[], None],
    poll: float = RELEASE_POLL,
) -> None:
    """Read `rel`'s GPUs every `poll` seconds until none is releasing. Past `timeout` the
    reasons name the stuck pid and its state; it goes on reading (the GPUs stay out).
    `read` (the GPUs) and `states` (/proc states of pids) run the blocking reads in a
    thread."""
    while True:
        await refresh_release(rel, await read(), await states(rel.pids),
                              timeout=timeout, on_change=on_change)
        if not rel.reasons:
            return
        await trio.sleep(poll)


async def refresh_release(rel: _Release, reading: Reading | None,
                          states: Mapping[int, str | None], *, timeout: float,
                          on_change: Callable[[], None]) -> None:
    elapsed = trio.current_time() - rel.began
    reasons = release_reasons(rel.gpus, rel.pids, reading, replica_id=rel.replica_id,
                              elapsed=elapsed, timeout=timeout, states=states,
                              free_before=rel.free_before)
    rel.alive = frozenset(p for p in rel.pids if states.get(p) is not None)
    if elapsed >= timeout and reasons and not rel.late:
        rel.late = True
        for uuid, why in reasons.items():
            log.warning("GPU %s: %s", uuid, why)
    if reasons != rel.reasons:
        if not reasons:
            log.info("engine %s: GPUs %s released after %.1fs", rel.replica_id,
                     ",".join(rel.gpus), elapsed)
        rel.reasons = reasons
        on_change()


@define(eq=False)
class _Engine:
    record: EngineRecord
    health: bool  # False: liveness only (SGLang ranks > 0, headless and Ray members)
    report: EngineReport
    state: Phase | None = None  # moved only by engine_states.next_state
    stop_reason: str = ""
    # Why it failed (in a phase of FAILING): its exit's reason, which the stop that
    # follows the failure does not replace.
    failure: str = ""
    stop_requested: trio.Event = field(factory=trio.Event)
    done: trio.Event = field(factory=trio.Event)
    settled: trio.Event = field(factory=trio.Event)  # left "starting" (or never will)
    # Processes seen in its session (the leader included): whose GPU memory must go.
    pids: set[int] = field(factory=set)
    # Loads and unloads its LoRA adapters while it runs; None: an engine that cannot.
    adapters: AdapterKeeper | None = None
    # Where its launcher writes the pre-flight's result (preflight_report); "": no probe.
    preflight_path: str = ""

    @property
    def spec(self) -> EngineSpec:
        return self.record.spec


class Supervisor:
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
    ) -> None:
        self._config = config
        # Called (on the event loop, must not block) with a copy of weights an engine
        # died reading, and the engine's words (llmgw.agent.lifecycle.bad_copies).
        self._on_bad_copy = on_bad_copy
        # This node's last storage scan: the default plan starts engines on the copy it
        # found (or downloads into download_dir), and the record says which. Only with the
        # default plan: what a plan given here loads is its own business.
        self._storage = storage if plan is None else None
        # Read right before each spawn of an engine with GPUs (their NVML indices, health,
        # free memory and holders) and after each such engine ends (its memory back).
        # None: specs with GPUs are refused, since no CUDA index can be given to them.
        self._gpu_memory = gpu_memory
        # Bytes of the complete local copy of a model (0: unknown), for the startup floor.
        # Called on the event loop: it must not block.
        self._model_size = model_size
        # Called (on the event loop, must not block) when releasing() or engine_pids()
        # changes: an engine spawned, a session ended, a GPU released or its reason moved.
        self._on_gpus_changed = on_gpus_changed
        self._releases: list[_Release] = []
        # replica id -> each GPU's free MiB read right before its engine's spawn, until its
        # record keeps it (EngineRecord.gpu_free_before: an adopted engine has it too).
        self._free_before: dict[str, dict[str, int]] = {}
        # Called when an engine's command does not resolve: the agent runs discovery
        # again, so that its inventory says so.
        self._on_unavailable = on_unavailable
        self._keys = command_keys(config, python)
        self._sup = config.supervisor
        self._on_report = on_report
        self._plan: PlanFn = plan or default_plan(config, python, storage, inventory)
        self._engines: dict[str, _Engine] = {}
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
            self._new_adapters(desired)
            self._new_sleep(desired)
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

    def _new_adapters(self, desired: tuple[EngineSpec, ...]) -> None:
        """A running engine whose spec changed only in its adapters (the server updates a
        replica in place for that, generation and all) keeps running: its record takes the
        new spec, and its keeper loads and unloads the difference."""
        for spec in desired:
            eng = self._engines.get(spec.replica_id)
            if eng is None or eng.spec.generation != spec.generation or eng.spec.adapters == spec.adapters:
                continue
            eng.record = evolve(eng.record, spec=evolve(eng.spec, adapters=spec.adapters,
                                                        origin=spec.origin))
            try:
                write_record(self._sup.work_dir, eng.record)
            except OSError as exc:  # the engine runs on; an adopting agent syncs again anyway
                log.warning("engine %s: cannot write its record: %s", spec.replica_id, exc)
            log.info("engine %s gen %d: adapters now %s", spec.replica_id, spec.generation,
                     ", ".join(a.name for a in spec.adapters) or "none")
            if eng.adapters is not None:
                eng.adapters.poke()

    def _new_sleep(self, desired: tuple[EngineSpec, ...]) -> None:
        """autoscale.sleep_when_idle: a running engine whose spec changed only in `asleep`
        is put to sleep or woken in place (agent/lifecycle/sleep.py), by its API server's head."""
        for spec in desired:
            eng = self._engines.get(spec.replica_id)
            if eng is None or eng.spec.generation != spec.generation or eng.spec.asleep == spec.asleep:
                continue
            eng.record = evolve(eng.record, spec=evolve(eng.spec, asleep=spec.asleep))
            try:
                write_record(self._sup.work_dir, eng.record)
            except OSError as exc:  # it sleeps or wakes anyway; the server's next set says again
                log.warning("engine %s: cannot write its record: %s", spec.replica_id, exc)
            self._follow_sleep(eng)

    def _follow_sleep(self, eng: _Engine) -> None:
        if not eng.health:  # a headless member: its head's API server sleeps the gang
            return
        rid = eng.spec.replica_id

        def wanted() -> bool | None:
            return eng.spec.asleep if self._engines.get(rid) is eng else None

        self._nursery_or_raise().start_soon(
            engine_sleep.follow, self._config.mgmt_addr, eng.spec.port, rid, wanted,
            eng.record.api_key)

    def _unreadable_copy(self, eng: _Engine, tail: tuple[str, ...]) -> str:
        """An engine that died starting, whose log says its weights could not be read:
        the copy it was given goes to on_bad_copy (the node stops offering it) and the
        exit reason says so; "" otherwise."""
        why = unreadable_reason(tail)
        if not why or self._storage is None or self._on_bad_copy is None:
            return ""
        copy = weights_for(eng.spec, self._config, self._storage()).copy
        if copy is None or copy.path not in eng.record.weights:
            return ""  # a download, a path as written, or the scan moved on: nothing to mark
        log.warning("engine %s: could not read its weights at %s: %s", eng.spec.replica_id,
                    copy.path, why)
        try:
            self._on_bad_copy(copy, why)
        except Exception:
            log.exception("on_bad_copy failed")
        return f"; it could not read the copy at {copy.path}, which this node no longer offers"

    def _keeper(self, eng: _Engine) -> AdapterKeeper | None:
        spec = eng.spec
        if not eng.health or not spec.max_loras or spec.engine not in RUNTIME_ADAPTERS:
            return None

        def wanted() -> tuple[str, tuple[Adapter, ...]]:
            return eng.spec.served_name or eng.spec.model, eng.spec.adapters

        def on_result(result: SyncResult) -> None:
            if (result.loaded, result.errors) == (eng.report.adapters, eng.report.adapter_errors):
                return
            eng.report = evolve(eng.report, adapters=result.loaded, adapter_errors=result.errors)
            self._call(eng.report)

        return AdapterKeeper(self._config.mgmt_addr, spec.port, spec.replica_id, wanted,
                             lambda: eng.state is Phase.READY, on_result, eng.record.api_key)

    def releasing(self) -> dict[str, str]:
        """GPU UUID -> why it is not back yet, for each GPU of an ended engine whose
        memory has not come back (Gpu.releasing in the inventory)."""
        out: dict[str, str] = {}
        for rel in self._releases:
            for uuid, why in rel.reasons.items():
                out.setdefault(uuid, why)
        return out

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
        for rel in self._releases:
            out.update(rel.alive)
        return frozenset(out)

    def log_tail(self, replica_id: str, lines: int) -> tuple[str, ...]:
        try:
            path = os.path.join(engine_dir(self._sup.work_dir, replica_id), LOG)
        except ValueError:
            return ()
        return tail_lines(path, lines)

    # ---- internals ----

    def _event(self, eng: _Engine, event: EngineEvent, reason: str,
               **changes: object) -> None:
        """Move `eng` through the lifecycle table; report when its phase changed, with
        `reason` (the table holds none: the caller knows the pid, the code, the timeout)."""
        was, phase = eng.state, next_state(eng.state, event)
        eng.state = phase
        if phase is not Phase.STARTING:
            eng.settled.set()
        if phase is Phase.READY and eng.adapters is not None:
            eng.adapters.poke()  # a fresh or restarted engine has none of them yet
        if phase is Phase.READY and was is not Phase.READY and eng.spec.asleep:
            self._follow_sleep(eng)  # started (or adopted) while its deployment sleeps
        if phase is was:
            return  # a no-op pair of the table: nothing to report
        state = reported(phase)
        eng.report = evolve(eng.report, state=state, reason=reason, **changes)  # type: ignore[arg-type]
        log.info("engine %s gen %d: %s (%s)", eng.spec.replica_id, eng.spec.generation,
                 state, reason)
        self._call(eng.report)

    def _note_preflight(self, eng: _Engine, *, report: bool = True) -> None:
        """Take the probe's result into the engine's report once the launcher wrote it;
        report it (the server's replica moves out of its pre-flight on it)."""
        got = read_preflight(eng.preflight_path)
        if got is None:
            return
        eng.report = evolve(eng.report, preflight=got.line, preflight_busbw_gbps=got.busbw_gbps,
                            # The probe's rendezvous port was taken: the server places the
                            # replica again, that port blocked on this node.
                            conflict_port=got.port or eng.report.conflict_port)
        log.info("engine %s gen %d: pre-flight %s", eng.spec.replica_id, eng.spec.generation,
                 got.line)
        if report:
            self._call(eng.report)

    def _gpus_changed(self) -> None:
        if self._on_gpus_changed is None:
            return
        try:
            self._on_gpus_changed()
        except Exception:
            log.exception("on_gpus_changed failed")

    def _read_gpus(self) -> Reading | None:
        """One reading of the GPUs (blocking); None when there is no reader or it fails."""
        if self._gpu_memory is None:
            return None
        try:
            return self._gpu_memory()
        except Exception as exc:  # a reader bug or an NVML error: "cannot read" for now
            log.warning("reading the GPUs failed: %s", exc)
            return None

    async def _read_gpus_async(self) -> Reading | None:
        return await trio.to_thread.run_sync(self._read_gpus)

    async def _gpu_indices(self, spec: EngineSpec) -> dict[str, int] | str:
        """The NVML index of each of the spec's GPUs, or why it must not start now.

        No GPUs: nothing to map, nothing to check. GPUs with no reader, or a reader that
        cannot read: refused, since CUDA_VISIBLE_DEVICES takes indices, and a guess (the
        position in the spec, the last inventory's) could hand the engine someone else's
        GPU. The integrator gives GPU-less or NVML-less nodes a reader made from the
        inventory (gpu_memory.from_inventory)."""
        if not spec.gpus:
            return {}
        if self._gpu_memory is None:
            return (f"no GPU reader on this agent to map GPUs {','.join(spec.gpus)} to "
                    "CUDA devices")
        deadline = trio.current_time() + START_RELEASE_WAIT
        while True:
            reading = await self._read_gpus_async()
            if reading is None:
                return f"cannot read the GPUs (NVML) to map {','.join(spec.gpus)} to CUDA devices"
            mine = [r for r in self._releases if set(r.gpus) & set(spec.gpus) and r.reasons]
            for rel in mine:  # this fresh reading may show them back already
                states = await _pid_states_async(rel.pids)
                await refresh_release(rel, reading, states, timeout=self._sup.release_timeout,
                                      on_change=self._gpus_changed)
            own = frozenset(p for r in self._releases if r.replica_id == spec.replica_id
                            for p in r.pids)
            verdict = check_gpus(spec, reading, self.releasing(), own)
            if not isinstance(verdict, str):
                self._free_before[spec.replica_id] = {
                    u: reading[u].free for u in spec.gpus if u in reading}
            if (not isinstance(verdict, str) or not any(u in self.releasing() for u in spec.gpus)
                    or trio.current_time() >= deadline):
                return verdict
            await trio.sleep(START_RELEASE_POLL)

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
        indices = await self._gpu_indices(spec)
        if isinstance(indices, str):
            self._refuse(spec, restarts, log_path, f"not started: {indices}")
            return
        devices = tuple(indices[u] for u in spec.gpus)
        free = self._free_before.pop(rid, {})
        # Its own API key (issue 30), new at every spawn; kept in the record (0600), so that
        # an agent that adopts it sends the same one.
        record = EngineRecord(spec=spec, log_path=log_path, ports=(spec.port,), restarts=restarts,
                              api_key=new_key(),
                              cuda_devices=devices,
                              gpu_free_before=tuple(free[u] for u in spec.gpus)
                              if all(u in free for u in spec.gpus) else ())
        try:
            plan: LaunchPlan = self._plan(spec, indices)
            # The same pure answer the plan just got from the same scan (nothing awaited
            # in between), for the record, the report and the log.
            weights = (weights_for(spec, self._config, self._storage()).reason
                       if self._storage is not None else "")
            record = evolve(record, weights=weights)
        except LlmgwError as exc:  # a config the spec cannot run with: said, no traceback
            self._refuse(spec, restarts, log_path, f"could not start: {exc}")
            return
        missing = missing_command(plan, self._keys)
        if missing:
            self._refuse(spec, restarts, log_path, f"could not start: {missing}")
            if self._on_unavailable is not None:
                self._on_unavailable()
            return
        if plan.health_checked and not ports.port_free(self._config.mgmt_addr, spec.port):
            conflict = ports.taken_by(self._config.mgmt_addr, spec.port)
            self._refuse(spec, restarts, log_path, f"not started: {conflict.reason}",
                         conflict_port=spec.port)
            return
        if spec.gpus:
            mapping = (f"GPUs {','.join(spec.gpus)} as CUDA devices "
                       f"{','.join(str(i) for i in devices)}")
            log.info("engine %s gen %d: %s", rid, spec.generation, mapping)
            _note(log_path, rid, mapping)
        if weights:
            log.info("engine %s gen %d: weights %s", rid, spec.generation, weights)
            _note(log_path, rid, f"weights {weights}")
        pre_path = preflight_path(folder, spec)
        if pre_path:
            # A result of an earlier start of this replica is not this one's.
            try:
                os.remove(pre_path)
            except FileNotFoundError:
                pass  # the usual case: a first start
            except OSError as exc:
                log.warning("engine %s: cannot remove the old %s: %s", rid, pre_path, exc)
        try:
            # Pending first: an agent killed between spawn and the completed record
            # finds the engine again by its LLMGW_REPLICA_ID tag instead of starting twice.
            write_record(self._sup.work_dir, record)
            pid = spawn_plan(plan, folder, log_path,
                                   procs.replica_tag(rid, spec.generation), record.api_key)
            started = procs.start_time(pid)
            if started is None:  # died at once; its exit is reaped by the watcher below
                started = 0
            record = record.completed(pid, pid, started)
            write_record(self._sup.work_dir, record)
        except OSError as exc:  # the spawn itself (a command that vanished, no permission)
            remove_record(self._sup.work_dir, rid)
            self._refuse(spec, restarts, log_path, f"could not start: {exc}")
            return
        except Exception as exc:
            log.exception("engine %s could not be started", rid)
            remove_record(self._sup.work_dir, rid)
            self._refuse(spec, restarts, log_path, f"could not start: {exc}", logged=True)
            return
        if plan.env_overrides:
            log.info("engine %s: the deployment's env replaces llmgw's %s", rid,
                     ", ".join(plan.env_overrides))
        eng = _Engine(record=record, health=plan.health_checked,
                      report=EngineReport(rid, spec.generation, EngineState.STARTING,
                                          endpoint=self._endpoint(spec, plan.health_checked),
                                          api_key=self._key(record, plan.health_checked),
                                          pid=pid, restarts=restarts, weights=weights,
                                          preflight=PREFLIGHT_RUNNING if pre_path else ""),
                      preflight_path=pre_path)
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
        _note(log_path, rid, reason)
        report = EngineReport(rid, spec.generation, reported(next_state(None, EngineEvent.EXITED)),
                              reason=reason, restarts=restarts, conflict_port=conflict_port,
                              log_tail=tail_lines(log_path, self._sup.log_lines))
        self._exited[rid] = report
        self._call(report)

    def _conflict(self, eng: _Engine, conflict: PortConflict) -> None:
        """Another process answers on `eng`'s port: never ready; stop it, say who."""
        if eng.state in FAILING:
            return
        eng.failure = conflict.reason
        self._event(eng, EngineEvent.PORT_CONFLICT, conflict.reason, conflict_port=conflict.port)
        eng.stop_reason = "its port is answered by another process"
        eng.stop_requested.set()

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
        eng = _Engine(record=record, health=health,
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
        eng.stop_reason = stop.reason
        eng.stop_requested.set()
        await eng.done.wait()

    async def _run(self, eng: _Engine) -> None:
        try:
            await self._watch(eng)
        except Exception:  # a bug here must not take down the other engines
            log.exception("engine %s: watcher failed; engine left running, unwatched",
                          eng.spec.replica_id)
            self._engines.pop(eng.spec.replica_id, None)
            eng.done.set()

    async def _watch(self, eng: _Engine) -> None:
        rec = eng.record
        killed = False
        health_scope = trio.CancelScope()
        adapters_scope = trio.CancelScope()
        preflight_scope = trio.CancelScope()
        async with trio.open_nursery() as nursery:

            async def health() -> None:
                with health_scope:
                    await self._watch_health(eng)

            async def keep_adapters(keeper: AdapterKeeper) -> None:
                with adapters_scope:  # as health: it asks the engine until it stops or exits
                    await keeper.run()

            async def preflight() -> None:
                with preflight_scope:  # until the launcher wrote the probe's result
                    while eng.report.preflight == PREFLIGHT_RUNNING:
                        await trio.sleep(PREFLIGHT_POLL)
                        self._note_preflight(eng)

            async def stopper() -> None:
                nonlocal killed
                await eng.stop_requested.wait()
                health_scope.cancel()
                adapters_scope.cancel()
                preflight_scope.cancel()
                self._event(eng, EngineEvent.STOP_REQUESTED, eng.stop_reason)
                eng.pids.update(procs.session_pids(rec.sid))  # whose GPU memory must go
                killed = await procs.stop_session(rec.sid, self._sup.stop_timeout)

            nursery.start_soon(stopper)
            eng.adapters = self._keeper(eng)
            if eng.adapters is not None:
                nursery.start_soon(keep_adapters, eng.adapters)
            if eng.preflight_path:
                nursery.start_soon(preflight)
            if eng.health:
                nursery.start_soon(health)
            else:
                self._event(eng, EngineEvent.HEALTH_OK, "running (watched for liveness only)")
            code = await procs.wait_exit(rec.pid, rec.start_time)
            health_scope.cancel()
            adapters_scope.cancel()
            preflight_scope.cancel()
            if not eng.stop_requested.is_set():
                nursery.cancel_scope.cancel()  # the stopper has nothing left to stop
        # The leader is gone; members it left in its session (its workers, Ray) go too.
        left = procs.session_pids(rec.sid)
        eng.pids.update(left)
        if left:
            if not eng.stop_requested.is_set():
                # Not ready from this moment (a ready one): stopping what is left (vLLM's
                # EngineCore and workers) can take up to stop_timeout, and the routers must
                # not wait for it.
                self._event(eng, EngineEvent.LEADER_EXITED,
                            "engine process exited; stopping what is left of its session")
            killed = await procs.stop_session(rec.sid, self._sup.stop_timeout) or killed
        failed = eng.state in FAILING
        taken = ""
        if eng.health and not eng.stop_requested.is_set() and eng.state is Phase.STARTING:
            # Died before its first 200: when someone else now holds its port, that is why.
            conflict = await trio.to_thread.run_sync(self._port_taken, rec.spec.port)
            if conflict is not None:
                taken = f"{conflict.reason} (the engine exited before it was ready)"
                eng.report = evolve(eng.report, conflict_port=conflict.port)
        if failed:
            reason = eng.failure
        elif taken:
            reason = taken
        elif eng.stop_requested.is_set():
            reason = f"stopped: {eng.stop_reason}"
            if killed:
                reason += f" (SIGKILL after {self._sup.stop_timeout:g}s)"
        elif code is None:
            reason = "exited (exit code unknown: adopted process)"
        else:
            reason = f"exited with code {code}"
        tail = tail_lines(rec.log_path, self._sup.log_lines)
        if eng.state is Phase.STARTING and not eng.stop_requested.is_set():
            reason += self._unreadable_copy(eng, tail)
        del self._engines[rec.spec.replica_id]
        remove_record(self._sup.work_dir, rec.spec.replica_id)
        # Releasing before the exit is reported: a server that places again on hearing it
        # must already find these GPUs out (the inventory says so once it is sent).
        self._begin_release(eng)
        if eng.report.preflight == PREFLIGHT_RUNNING:
            # A launcher that exited on a failed probe wrote why: the exit report says it.
            self._note_preflight(eng, report=False)
        self._event(eng, EngineEvent.EXITED, reason, exit_code=code, log_tail=tail)
        if not eng.stop_requested.is_set() or failed:
            self._exited[rec.spec.replica_id] = eng.report
        eng.done.set()

    def _begin_release(self, eng: _Engine) -> None:
        """Hold `eng`'s GPUs as releasing until the reader shows its memory back. Without a
        reader there is nothing to watch with: they are free at once, as before."""
        spec = eng.spec
        if not spec.gpus or self._gpu_memory is None or self._nursery is None:
            self._gpus_changed()  # its pids left engine_pids()
            return
        rel = _Release(spec.replica_id, spec.gpus, frozenset(eng.pids), trio.current_time(),
                       {u: f"releasing after {spec.replica_id} stopped" for u in spec.gpus},
                       alive=frozenset(eng.pids),
                       free_before=dict(zip(spec.gpus, eng.record.gpu_free_before, strict=False)))
        self._releases.append(rel)
        self._gpus_changed()
        self._nursery.start_soon(self._release, rel)

    async def _release(self, rel: _Release) -> None:
        # Cancelled (the agent stopping) with memory still held, the release ends with the
        # agent: a restarted one sees the stuck process as foreign on the GPU, so
        # placement still avoids it.
        try:
            await watch_release(rel, self._read_gpus_async, _pid_states_async,
                                timeout=self._sup.release_timeout, on_change=self._gpus_changed)
        except Exception:  # a bug here must not take the agent down
            log.exception("engine %s: watching its GPUs' release failed; they stay out "
                          "until the agent restarts", rel.replica_id)
            return
        self._releases.remove(rel)

    def _port_taken(self, port: int) -> PortConflict | None:
        if ports.port_free(self._config.mgmt_addr, port):
            return None
        return ports.taken_by(self._config.mgmt_addr, port)

    async def _watch_health(self, eng: _Engine) -> None:
        host, port = self._config.mgmt_addr, eng.spec.port
        answered = 0

        timeout = probe_timeout(eng.spec.engine, eng.spec.env, self._sup.health_timeout)
        size = 0
        if self._model_size is not None:
            try:
                size = max(0, int(self._model_size(eng.spec.model)))
            except Exception as exc:  # the floor is a help, never a reason not to start
                log.warning("engine %s: size of %s unknown: %s", eng.spec.replica_id,
                            eng.spec.model, exc)
        # An engine downloading its weights: the bytes on disk, reported and counted as
        # progress (download_progress.py); "": it loads a copy, nothing to watch.
        repo = self._download_repo(eng.spec)

        async def on_disk() -> int:
            # In a thread: download_dir may be on NFS or Lustre, and a stuck server must
            # not stop the agent's loop (its heartbeats) while this engine starts.
            return await trio.to_thread.run_sync(lambda: downloaded(read_listing(repo)),
                                                 abandon_on_cancel=True)

        began = trio.current_time()
        listed = await on_disk() if repo else 0
        progress = DownloadProgress.start(listed, began)
        told = began
        clock = StartupDeadline.start(began, eng.spec.startup_timeout,
                                      cap=self._sup.startup_max, size_bytes=size,
                                      log_size=_size(eng.record.log_path),
                                      downloaded=progress.last_bytes)

        def deadline(now: float) -> float:
            nonlocal clock, progress, told
            if repo:
                progress = progress.observe(listed, now)
                if now - told >= DOWNLOAD_REPORT_EVERY:
                    told = now
                    line = progress.line()
                    if line != eng.report.download:
                        eng.report = evolve(eng.report, download=line)
                        self._call(eng.report)
            # The new bytes too: lines that only say the engine waits are not progress.
            size = _size(eng.record.log_path)
            clock = clock.observe(size, now, progress.last_bytes,
                                  _new_bytes(eng.record.log_path, clock.last_size, size))
            return clock.deadline

        async def probe() -> bool:
            nonlocal answered, listed
            if repo and eng.state is not Phase.READY:  # what deadline() observes next
                listed = await on_disk()
            began = trio.current_time()
            ok = await http_health(host, port, timeout=timeout, key=eng.record.api_key)
            self.on_probe(trio.current_time() - began, ok)
            if not ok:
                return False
            if eng.state is Phase.READY:
                await self._note_in_flight(eng, host, port, timeout)
            # A 200 counts only from the engine's own session: on the way to ready, and
            # every OWNER_CHECK_EVERY answers after that.
            due = eng.state is not Phase.READY or answered % OWNER_CHECK_EVERY == 0
            answered += 1
            if not due or eng.record.sid <= 0:
                return True
            conflict = await trio.to_thread.run_sync(ports.owner_conflict, host, port,
                                                     eng.record.sid)
            if conflict is None:
                return True
            self._conflict(eng, conflict)
            return False

        def on_event(event: HealthEvent) -> None:
            if event is HealthEvent.READY:
                self._event(eng, EngineEvent.HEALTH_OK, "health check answered 200")
            elif event is HealthEvent.UNHEALTHY:
                self._event(eng, EngineEvent.HEALTH_FAIL, "three health checks failed in a row")
            else:
                now = trio.current_time()
                why = clock.expired(now) or f"not ready within {now - clock.began:.0f}s"
                self._event(eng, EngineEvent.STARTUP_TIMEOUT, why)
                if eng.state is Phase.FAILED:  # not a timer that raced the first 200
                    eng.failure = why
                    eng.stop_reason = "failed to start in time"
                    eng.stop_requested.set()

        await watch_health(probe, interval=self._sup.health_interval,
                           startup_timeout=eng.spec.startup_timeout, on_event=on_event,
                           deadline=deadline)

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

    async def _note_in_flight(self, eng: _Engine, host: str, port: int, timeout: float) -> None:
        """Read the engine's requests in flight; report when it moved between none, some
        and unknown (inflight.py): what ends a drain early."""
        n = await read_in_flight(host, port, timeout=timeout, key=eng.record.api_key)
        if inflight_changed(eng.report.in_flight, n):
            eng.report = evolve(eng.report, in_flight=n)
            self._call(eng.report)


def _size(path: str) -> int:
    """The size of an engine's log (its progress while starting); -1 when unreadable."""
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


def _new_bytes(path: str, since: int, size: int) -> bytes | None:
    """The log's bytes from `since` to `size`, the last TAIL_MAX of them (what the startup
    deadline judges); b"" when it did not grow, None when they cannot be read. A few KiB
    of a local file, read on the loop as _size stats it."""
    if size <= since or since < 0:
        return b""
    start = max(since, size - TAIL_MAX)
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(size - start)
    except OSError:
        return None


def _pid_states(pids: frozenset[int]) -> dict[int, str | None]:
    return {pid: procs.state_of(pid) for pid in pids}


async def _pid_states_async(pids: frozenset[int]) -> dict[int, str | None]:
    return await trio.to_thread.run_sync(_pid_states, pids)


def _note(log_path: str, rid: str, line: str) -> None:
    """A line of the agent's own in the engine's log, for `ctl logs` and the log tail."""
    try:
        with open(log_path, "a") as f:
            f.write(f"llmgw agent: {line}\n")
    except OSError as exc:
        log.debug("engine %s: cannot write %s: %s", rid, log_path, exc)

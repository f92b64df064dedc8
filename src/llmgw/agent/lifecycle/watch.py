"""The watcher of one engine, from its spawn (or adoption) to its exit: its stopper, its
health watcher, its adapters' keeper and its pre-flight's result in one nursery, then the
end of its session, the exit's reason (composed by its lifecycle), its GPUs' release and
its last report. A part of the Supervisor (a base class of it), in its own module."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio
from attrs import evolve

from llmgw.agent.discovery.procnet import PortConflict
from llmgw.agent.engines import weights_for
from llmgw.agent.kvevents.feeds import KvFeeds
from llmgw.agent.lifecycle import inplace
from llmgw.agent.lifecycle.bad_copies import unreadable_reason
from llmgw.agent.lifecycle.engine import Engine
from llmgw.agent.lifecycle.health_watch import HealthWatch
from llmgw.agent.lifecycle.logtail import tail_lines
from llmgw.agent.lifecycle.preflight_report import RUNNING as PREFLIGHT_RUNNING
from llmgw.agent.lifecycle.preflight_report import read_result as read_preflight
from llmgw.agent.lifecycle.records import remove_record
from llmgw.agent.lifecycle.releases import GpuReleases
from llmgw.agent.lifecycle.states import EngineEvent
from llmgw.agent.lora.sync import AdapterKeeper
from llmgw.agent.process import ports, procs
from llmgw.agent.process.spawn import StorageFn
from llmgw.config.agent import AgentConfig, SupervisorConfig
from llmgw.model.engine import EngineReport
from llmgw.model.inventory import ModelCopy

log = logging.getLogger(__name__)

# Seconds between looks for the pre-flight's result while the launcher runs the probe: a
# stat of one file; the server hears of the result within this of it being written.
PREFLIGHT_POLL = 0.5


class Watching:
    """The Supervisor's per-engine watcher; the attributes are the Supervisor's."""

    _config: AgentConfig
    _sup: SupervisorConfig
    _storage: StorageFn | None
    _on_bad_copy: Callable[[ModelCopy, str], None] | None
    _engines: dict[str, Engine]
    _exited: dict[str, EngineReport]
    _nursery: trio.Nursery | None
    releases: GpuReleases
    health: HealthWatch
    _kv: KvFeeds | None

    def _event(self, eng: Engine, event: EngineEvent, reason: str, **changes: object) -> None:
        raise NotImplementedError

    def _call(self, report: EngineReport) -> None:
        raise NotImplementedError

    def _note_preflight(self, eng: Engine, *, report: bool = True) -> None:
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

    async def _run(self, eng: Engine) -> None:
        try:
            await self._watch(eng)
        except Exception:  # a bug here (an InvalidTransition too) must not take down the others
            log.exception("engine %s: watcher failed; engine left running, unwatched",
                          eng.spec.replica_id)
            self._engines.pop(eng.spec.replica_id, None)
            if self._kv is not None:
                self._kv.end(eng.spec.replica_id)
            eng.done.set()

    async def _watch(self, eng: Engine) -> None:
        rec = eng.record
        killed = False
        health_scope = trio.CancelScope()
        adapters_scope = trio.CancelScope()
        preflight_scope = trio.CancelScope()
        async with trio.open_nursery() as nursery:

            async def health() -> None:
                with health_scope:
                    await self.health.watch(eng)

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
                self._event(eng, EngineEvent.STOP_REQUESTED, eng.life.stop_reason)
                eng.pids.update(procs.session_pids(rec.sid))  # whose GPU memory must go
                killed = await procs.stop_session(rec.sid, self._sup.stop_timeout)

            nursery.start_soon(stopper)
            eng.adapters = inplace.keeper(eng, self._config.mgmt_addr,
                                          lambda e: self._call(e.report))
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
            if not eng.life.stop_asked:
                nursery.cancel_scope.cancel()  # the stopper has nothing left to stop
        # The leader is gone; members it left in its session (its workers, Ray) go too.
        left = procs.session_pids(rec.sid)
        eng.pids.update(left)
        if left:
            if not eng.life.stop_asked:
                # Not ready from this moment (a ready one): stopping what is left (vLLM's
                # EngineCore and workers) can take up to stop_timeout, and the routers must
                # not wait for it.
                self._event(eng, EngineEvent.LEADER_EXITED,
                            "engine process exited; stopping what is left of its session")
            killed = await procs.stop_session(rec.sid, self._sup.stop_timeout) or killed
        taken = ""
        if eng.health and eng.life.died_starting():
            # Died before its first 200: when someone else now holds its port, that is why.
            conflict = await trio.to_thread.run_sync(self._port_taken, rec.spec.port)
            if conflict is not None:
                taken = f"{conflict.reason} (the engine exited before it was ready)"
                eng.report = evolve(eng.report, conflict_port=conflict.port)
        reason = eng.life.exit_reason(code=code, killed=killed,
                                      stop_timeout=self._sup.stop_timeout, port_taken=taken)
        tail = tail_lines(rec.log_path, self._sup.log_lines)
        if eng.life.died_starting():
            reason += self._unreadable_copy(eng, tail)
        del self._engines[rec.spec.replica_id]
        if self._kv is not None:  # no engine, no stream: its routers hear Gone
            self._kv.end(rec.spec.replica_id)
        remove_record(self._sup.work_dir, rec.spec.replica_id)
        # Releasing before the exit is reported: a server that places again on hearing it
        # must already find these GPUs out (the inventory says so once it is sent).
        self.releases.begin(self._nursery, eng.spec.replica_id, eng.spec.gpus,
                            frozenset(eng.pids), eng.record.gpu_free_before)
        if eng.report.preflight == PREFLIGHT_RUNNING:
            # A launcher that exited on a failed probe wrote why: the exit report says it.
            self._note_preflight(eng, report=False)
        self._event(eng, EngineEvent.EXITED, reason, exit_code=code, log_tail=tail)
        if eng.life.server_hears():
            self._exited[rec.spec.replica_id] = eng.report
        eng.done.set()

    def _unreadable_copy(self, eng: Engine, tail: tuple[str, ...]) -> str:
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

    def _port_taken(self, port: int) -> PortConflict | None:
        if ports.port_free(self._config.mgmt_addr, port):
            return None
        return ports.taken_by(self._config.mgmt_addr, port)


"""The start pipeline of one engine: from a spec to a spawned process with its record
written, or to the reason it was not started.

Six exits refuse it, each with its reason: its GPUs cannot be mapped to CUDA devices (or
are not free), the config cannot make its launch plan, its command does not resolve, its
port is taken, the spawn fails (an OSError), or anything else breaks (a bug, logged with
its traceback). The supervisor reports a refusal as an exit without a process."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from attrs import define, evolve

from llmgw.agent.discovery.engine_check import missing_command
from llmgw.agent.engines import LaunchPlan, weights_for
from llmgw.agent.lifecycle.preflight_report import result_path as preflight_path
from llmgw.agent.lifecycle.records import EngineRecord, new_key, remove_record, write_record
from llmgw.agent.lifecycle.releases import GpuReleases
from llmgw.agent.process import ports, procs
from llmgw.agent.process.spawn import PlanFn, StorageFn, spawn_plan
from llmgw.config.agent import AgentConfig
from llmgw.errors import LlmgwError
from llmgw.model.engine import EngineSpec

log = logging.getLogger(__name__)


@define(frozen=True)
class Refused:
    """Not started, and why (said in the report and the engine's log)."""

    reason: str
    conflict_port: int = 0  # its port, taken: the server places the replica again
    logged: bool = False  # already logged, with its traceback
    unavailable: bool = False  # its command does not resolve: run discovery again


@define(frozen=True)
class Spawned:
    record: EngineRecord  # written, with the leader's pid
    plan: LaunchPlan
    weights: str  # which copy it loads, or where it downloads ("": a custom plan)
    preflight_path: str  # where its launcher writes the pre-flight's result; "": no probe


@define(frozen=True)
class Starter:
    """What every start of this supervisor shares."""

    config: AgentConfig
    plan: PlanFn
    keys: Mapping[str, str]  # engine_check.command_keys: configured command -> its key
    storage: StorageFn | None
    releases: GpuReleases

    async def start(self, spec: EngineSpec, restarts: int, folder: str,
                    log_path: str) -> Spawned | Refused:
        rid = spec.replica_id
        indices = await self.releases.indices(spec)
        if isinstance(indices, str):
            return Refused(f"not started: {indices}")
        devices = tuple(indices[u] for u in spec.gpus)
        free = self.releases.free_before.pop(rid, {})
        # Its own API key, new at every spawn (engine keys); kept in the record (0600),
        # so that an agent that adopts it sends the same one.
        record = EngineRecord(spec=spec, log_path=log_path, ports=(spec.port,), restarts=restarts,
                              api_key=new_key(),
                              cuda_devices=devices,
                              gpu_free_before=tuple(free[u] for u in spec.gpus)
                              if all(u in free for u in spec.gpus) else ())
        try:
            plan: LaunchPlan = self.plan(spec, indices)
            # The same pure answer the plan just got from the same scan (nothing awaited
            # in between), for the record, the report and the log.
            weights = (weights_for(spec, self.config, self.storage()).reason
                       if self.storage is not None else "")
            record = evolve(record, weights=weights)
        except LlmgwError as exc:  # a config the spec cannot run with: said, no traceback
            return Refused(f"could not start: {exc}")
        missing = missing_command(plan, self.keys)
        if missing:
            return Refused(f"could not start: {missing}", unavailable=True)
        host = self.config.mgmt_addr
        if plan.health_checked and not ports.port_free(host, spec.port):
            conflict = ports.taken_by(host, spec.port)
            return Refused(f"not started: {conflict.reason}", conflict_port=spec.port)
        if spec.gpus:
            mapping = (f"GPUs {','.join(spec.gpus)} as CUDA devices "
                       f"{','.join(str(i) for i in devices)}")
            log.info("engine %s gen %d: %s", rid, spec.generation, mapping)
            note(log_path, rid, mapping)
        if weights:
            log.info("engine %s gen %d: weights %s", rid, spec.generation, weights)
            note(log_path, rid, f"weights {weights}")
        pre_path = preflight_path(folder, spec)
        if pre_path:
            # A result of an earlier start of this replica is not this one's.
            try:
                os.remove(pre_path)
            except FileNotFoundError:
                pass  # the usual case: a first start
            except OSError as exc:
                log.warning("engine %s: cannot remove the old %s: %s", rid, pre_path, exc)
        work_dir = self.config.supervisor.work_dir
        try:
            # Pending first: an agent killed between spawn and the completed record
            # finds the engine again by its LLMGW_REPLICA_ID tag instead of starting twice.
            write_record(work_dir, record)
            pid = spawn_plan(plan, folder, log_path,
                             procs.replica_tag(rid, spec.generation), record.api_key)
            started = procs.start_time(pid)
            if started is None:  # died at once; its exit is reaped by the watcher
                started = 0
            record = record.completed(pid, pid, started)
            write_record(work_dir, record)
        except OSError as exc:  # the spawn itself (a command that vanished, no permission)
            remove_record(work_dir, rid)
            return Refused(f"could not start: {exc}")
        except Exception as exc:
            log.exception("engine %s could not be started", rid)
            remove_record(work_dir, rid)
            return Refused(f"could not start: {exc}", logged=True)
        if plan.env_overrides:
            log.info("engine %s: the deployment's env replaces llmgw's %s", rid,
                     ", ".join(plan.env_overrides))
        return Spawned(record, plan, weights, pre_path)


def note(log_path: str, rid: str, line: str) -> None:
    """A line of the agent's own in the engine's log, for `ctl logs` and the log tail."""
    try:
        with open(log_path, "a") as f:
            f.write(f"llmgw agent: {line}\n")
    except OSError as exc:
        log.debug("engine %s: cannot write %s: %s", rid, log_path, exc)

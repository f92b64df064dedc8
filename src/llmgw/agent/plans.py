"""The supervisor's view of a launch plan, and spawning one in a single new session.

`default_plan` adapts the launch plans in llmgw.agent.engines (pure: spec + config ->
processes). A plan of several processes (Ray head, then `vllm serve`) runs through
llmgw.agent.launcher so that every process shares one session with the recorded pid.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable

from attrs import field, frozen

from llmgw.agent import procs
from llmgw.config.agent import AgentConfig
from llmgw.model.engine import EngineKind, EngineSpec

log = logging.getLogger(__name__)


@frozen
class ProcSpec:
    argv: tuple[str, ...]
    env: dict[str, str] = field(factory=dict)  # added to the agent's own environment
    cwd: str | None = None


@frozen
class Plan:
    processes: tuple[ProcSpec, ...]  # the last one is the engine's main process
    health: bool = True  # False: no HTTP health to ask (only liveness)
    pre_delay: float = 0.0  # seconds between the earlier processes and the main one


PlanFn = Callable[[EngineSpec], Plan]


def has_health(spec: EngineSpec) -> bool:
    """Only a single-node engine or a gang's rank 0 has a /health worth asking."""
    return spec.gang is None or spec.gang.rank == 0


def _simulated(config: AgentConfig, python: str, spec: EngineSpec) -> Plan:
    argv = (python, "-m", "llmgw.simengine", "serve", spec.model,
            "--host", config.mgmt_addr, "--port", str(spec.port),
            "--served-model-name", spec.served_name,
            "--tensor-parallel-size", str(spec.tensor_parallel), *spec.args)
    return Plan((ProcSpec(argv, dict(spec.env)),), health=has_health(spec))


def default_plan(config: AgentConfig, python: str) -> PlanFn:
    try:
        from llmgw.agent.engines import build_plan  # type: ignore[attr-defined]
    except ImportError:
        build_plan = None

    def plan(spec: EngineSpec) -> Plan:
        if build_plan is None:
            if spec.engine is not EngineKind.SIMULATED:
                raise RuntimeError(f"no launch plan for engine {spec.engine}")
            return _simulated(config, python, spec)
        built = build_plan(spec, config, config.supervisor.work_dir, python=python)
        processes = tuple(
            ProcSpec(tuple(p.argv), dict(p.env), getattr(p, "cwd", None) or None)
            for p in built.processes
        )
        return Plan(processes, health=has_health(spec))

    return plan


def spawn_plan(plan: Plan, folder: str, log_path: str, tag: str) -> int:
    """Spawn `plan` in one new session, every process tagged LLMGW_REPLICA_ID=tag."""
    base = dict(os.environ)

    def env_of(p: ProcSpec) -> dict[str, str]:
        return {**base, **p.env, procs.REPLICA_ENV: tag}

    main = plan.processes[-1]
    if len(plan.processes) == 1:
        return procs.spawn(main.argv, env=env_of(main), cwd=main.cwd, log_path=log_path)
    doc = {
        "pre": [{"argv": list(p.argv), "env": env_of(p), "cwd": p.cwd}
                for p in plan.processes[:-1]],
        "main": {"argv": list(main.argv), "env": env_of(main), "cwd": main.cwd},
        "pre_delay": plan.pre_delay,
    }
    path = os.path.join(folder, "plan.json")
    with open(path, "w") as f:
        json.dump(doc, f)
    argv = (sys.executable, "-m", "llmgw.agent.launcher", path)
    return procs.spawn(argv, env=env_of(main), cwd=None, log_path=log_path)

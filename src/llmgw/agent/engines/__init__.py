"""Launch plans: pure functions from an engine spec and the agent's config to the
processes to start (argv, env, cwd). No trio, no os, no clock: the supervisor runs them.
"""

from __future__ import annotations

import posixpath

from llmgw.agent.engines.env import default_env, merge_env
from llmgw.agent.engines.plan import LaunchPlan, ProcessPlan
from llmgw.agent.engines.ray import RAY_PORT_BLOCK_SIZE, count_ray_nodes
from llmgw.agent.engines.sglang import sglang_plan
from llmgw.agent.engines.simulated import simulated_plan
from llmgw.agent.engines.vllm import vllm_plan
from llmgw.config.agent import AgentConfig
from llmgw.errors import EngineError
from llmgw.model.engine import EngineKind, EngineSpec

__all__ = [
    "RAY_PORT_BLOCK_SIZE",
    "LaunchPlan",
    "ProcessPlan",
    "build_plan",
    "count_ray_nodes",
    "engine_dir",
    "env_overrides",
]


def engine_dir(work_dir: str, spec: EngineSpec) -> str:
    """<work_dir>/engines/<replica>: the engine's cwd, log and Ray temp dir live here."""
    return posixpath.join(work_dir, "engines", spec.replica_id)


def env_overrides(spec: EngineSpec, config: AgentConfig) -> tuple[str, ...]:
    """The deployment env keys that replace a value llmgw would set (for the log)."""
    return merge_env(default_env(spec, config), spec.env)[1]


def _check(spec: EngineSpec) -> None:
    gang = spec.gang
    if gang is not None and not 0 <= gang.rank < gang.nnodes:
        raise EngineError(f"replica {spec.replica_id}: rank {gang.rank} is outside a gang of {gang.nnodes}")
    if "/" in spec.replica_id or spec.replica_id in ("", ".", ".."):
        raise EngineError(f"replica id {spec.replica_id!r} cannot name a folder")


def build_plan(spec: EngineSpec, config: AgentConfig, work_dir: str, *, python: str = "") -> LaunchPlan:
    """The processes to start for `spec` on this node.

    `python` is the interpreter for the simulated engine when
    `engines.simulated_python` is empty (the caller passes the agent's own).
    """
    _check(spec)
    cwd = engine_dir(work_dir, spec)
    env, overrides = merge_env(default_env(spec, config), spec.env)
    if spec.engine is EngineKind.VLLM:
        return vllm_plan((config.engines.vllm.bin,), spec, config, env, cwd, overrides)
    if spec.engine is EngineKind.SGLANG:
        return sglang_plan(spec, config, env, cwd, overrides)
    if spec.engine is EngineKind.SIMULATED:
        return simulated_plan(spec, config, python, env, cwd, overrides)
    raise EngineError(f"replica {spec.replica_id}: no launch plan for engine {spec.engine!r}")

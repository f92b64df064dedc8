"""Launch plans: what to start for an engine spec on this node. build.py builds them (pure
functions of the spec and the agent's config), plan.py is what a plan is, one module per
engine kind; this package's names are those."""

from __future__ import annotations

from llmgw.agent.engines.build import build_plan, engine_dir, env_overrides, health_checked
from llmgw.agent.engines.env import GPU_UUIDS_ENV, gpu_index_list
from llmgw.agent.engines.plan import LaunchPlan, Preflight, ProcessPlan
from llmgw.agent.engines.ray import RAY_PORT_BLOCK_SIZE, count_ray_nodes
from llmgw.agent.engines.weights import Weights, resolve_weights, weights_for

__all__ = [
    "GPU_UUIDS_ENV",
    "RAY_PORT_BLOCK_SIZE",
    "LaunchPlan",
    "Preflight",
    "ProcessPlan",
    "Weights",
    "build_plan",
    "count_ray_nodes",
    "engine_dir",
    "env_overrides",
    "gpu_index_list",
    "health_checked",
    "resolve_weights",
    "weights_for",
]

"""Launch plans built: pure functions from an engine spec and the agent's config to the
processes to start (argv, env, cwd). No trio, no os, no clock: the supervisor runs them.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping

from attrs import evolve

from llmgw.agent.engines.env import default_env, gpu_index_list, merge_env
from llmgw.agent.engines.plan import LaunchPlan
from llmgw.agent.engines.preflight import nccl_floor, preflight_for
from llmgw.agent.engines.sglang import sglang_plan
from llmgw.agent.engines.simulated import simulated_plan
from llmgw.agent.engines.vllm import vllm_plan
from llmgw.agent.engines.weights import Weights
from llmgw.config.agent import AgentConfig
from llmgw.errors import EngineError
from llmgw.model.affinity import GpuHca
from llmgw.model.engine import EngineKind, EngineSpec


def engine_dir(work_dir: str, spec: EngineSpec) -> str:
    """<work_dir>/engines/<replica>: the engine's cwd, log and Ray temp dir live here."""
    return posixpath.join(work_dir, "engines", spec.replica_id)


def env_overrides(spec: EngineSpec, config: AgentConfig, gpu_indices: Mapping[str, int]) -> tuple[str, ...]:
    """The deployment env keys that replace a value llmgw would set (for the log)."""
    return merge_env(default_env(spec, config, gpu_index_list(spec, gpu_indices)), spec.env)[1]


def health_checked(spec: EngineSpec) -> bool:
    """Whether GET /health on the spec's port tells the engine's health (LaunchPlan's
    field of that name), without building a plan: no GPU numbering needed, so a supervisor
    re-attaching to a running engine can ask it even where a GPU no longer resolves."""
    gang = spec.gang
    return gang is None or gang.nnodes <= 1 or gang.rank == 0


def _check(spec: EngineSpec) -> None:
    gang = spec.gang
    if gang is not None and not 0 <= gang.rank < gang.nnodes:
        raise EngineError(f"replica {spec.replica_id}: rank {gang.rank} is outside a gang of {gang.nnodes}")
    if "/" in spec.replica_id or spec.replica_id in ("", ".", ".."):
        raise EngineError(f"replica id {spec.replica_id!r} cannot name a folder")


def _floor(spec: EngineSpec, config: AgentConfig, nics: tuple[GpuHca, ...]) -> float:
    """The default NCCL floor of a gang member's pre-flight: its fabric's rate over the
    HCAs its GPUs ride (all the fabric's HCAs here where the map is unknown)."""
    gang = spec.gang
    if gang is None or not gang.hcas:
        return 0.0
    fabric = next((f for f in config.fabrics if set(gang.hcas) <= set(f.hcas)), None)
    if fabric is None:
        return 0.0
    return nccl_floor(fabric.rate_gbps, len({n.hca for n in nics}) or len(gang.hcas))


def build_plan(
    spec: EngineSpec,
    config: AgentConfig,
    work_dir: str,
    *,
    python: str = "",
    gpu_indices: Mapping[str, int],
    weights: Weights | None = None,
    nics: tuple[GpuHca, ...] = (),
    probe: tuple[str, str] = ("", ""),
    engine_version: str = "",
) -> LaunchPlan:
    """The processes to start for `spec` on this node.

    `gpu_indices` maps GPU UUID -> NVML index, read on this node right before the spawn:
    CUDA_VISIBLE_DEVICES gets the placed GPUs' indices in the spec's order (a placed UUID
    it lacks raises EngineError "GPU <uuid> is not on this node now: ..."). `python` is the
    interpreter for the simulated engine when `engines.simulated_python` is empty (the
    caller passes the agent's own).

    `weights` (llmgw.agent.engines.weights.weights_for, from this node's storage scan): the
    engine loads `weights.arg` (a copy's path, or the id to download) with `weights.env`
    (the deployment's env still wins), and vLLM and SGLang download into
    `weights.download_dir`; the
    served name stays the deployment's. None: the model as the deployment wrote it, as
    before weights were resolved.

    `nics` (llmgw.model.affinity.for_member, from this node's inventory): each placed
    GPU's nearest HCA of the gang's fabric, for UCX and vLLM's GPU -> NIC map (env.nic_env).

    `probe` (python, script): how the pre-flight a gang asks for is run (preflight.py),
    with the engine's own environment; ("", ""): none is run; ("", script): the engine's
    Python was not found (a required pre-flight is refused: EngineError).

    `engine_version`: the engine's version as this node's engine check read it ("" when
    unknown), for what differs between versions (env.vllm_port_hangs).
    """
    _check(spec)
    indices = gpu_index_list(spec, gpu_indices)
    cwd = engine_dir(work_dir, spec)
    defaults = default_env(spec, config, indices, nics, engine_version)
    download_dir = ""
    if weights is not None:
        defaults.update(weights.env)
        download_dir = weights.download_dir
        # The served name is fixed before the model argument changes under it: clients ask
        # for the deployment's name, never for a path on some node.
        spec = evolve(spec, model=weights.arg, served_name=spec.served_name or spec.model)
    env, overrides = merge_env(defaults, spec.env)
    if spec.engine is EngineKind.VLLM:
        plan = vllm_plan((config.engines.vllm.bin,), spec, config, env, cwd, overrides,
                         download_dir=download_dir)
    elif spec.engine is EngineKind.SGLANG:
        plan = sglang_plan(spec, config, env, cwd, overrides, download_dir=download_dir)
    elif spec.engine is EngineKind.SIMULATED:
        plan = simulated_plan(spec, config, python, env, cwd, overrides)
    else:
        raise EngineError(f"replica {spec.replica_id}: no launch plan for engine {spec.engine!r}")
    pre = None
    if probe[1]:  # a probe to run; no Python for it: preflight_for refuses or says why
        pre = preflight_for(spec, plan.main.env, probe[0], probe[1], cwd,
                            _floor(spec, config, nics))
    return evolve(plan, gpus=tuple(zip(spec.gpus, indices, strict=True)), preflight=pre)

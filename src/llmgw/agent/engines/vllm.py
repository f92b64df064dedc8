"""vLLM launch plans: one node, several nodes with `launch_mode: mp`, or with Ray.

Multi-node flags checked against the vLLM documentation for v0.11/v0.12 ("Parallelism
and scaling": every node runs `vllm serve MODEL --tensor-parallel-size T
--pipeline-parallel-size N --nnodes N --node-rank R --master-addr HEAD [--master-port P]`,
nodes other than rank 0 with `--headless`; Ray: `ray start` on every node, then
`vllm serve ... --distributed-executor-backend ray` on the head). The executor backend is
named explicitly in both modes so that vLLM's own choice cannot differ between versions.

`engine` is the command that stands for `vllm` (the vLLM binary, or for the simulated
engine `python -m llmgw.simengine`); everything after it is the same.
"""

from __future__ import annotations

from attrs import evolve

from llmgw.agent.engines import kv_events
from llmgw.agent.engines.plan import LaunchPlan, ProcessPlan
from llmgw.agent.engines.ray import RAY_DRAIN_ENV, ray_address, ray_start_argv, ray_status_argv, ray_temp_dir
from llmgw.config.agent import AgentConfig
from llmgw.config.vllm_serve import RUNTIME_LORA_ENV
from llmgw.errors import ConfigError, EngineError
from llmgw.model.engine import EngineSpec, GangSpec

LAUNCH_MODES = ("ray", "mp")
# vLLM (0.32 envs.py) mounts /v1/load_lora_adapter and /v1/unload_lora_adapter only with
# RUNTIME_LORA_ENV set ("1" or "true", any case; entrypoints/serve/lora/api_router.py),
# and refuses it with more than one API server (config/vllm_serve.py, checked at apply).
# vLLM (0.32 envs.py: bool(int(value))) mounts /sleep, /wake_up and /is_sleeping only
# with this set (entrypoints/launchers/api_server/routers.py -> serve/dev/sleep).
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
SLEEP_FLAG = "--enable-sleep-mode"


def lora_flags(spec: EngineSpec) -> tuple[str, ...]:
    """LoRA enabled with the deployment's limits, and nothing else: the adapters are
    loaded by the agent once the engine is ready (llmgw.agent.lora.adapters), not named with
    --lora-modules, because vLLM refuses to start when one static adapter fails to load
    (OpenAIServingModels.init_static_loras raises): one bad adapter path would take the
    base model down with it, where loaded at runtime it is one adapter's error.

    More adapters than --max-loras (the GPU slots, adapters per batch: vLLM's scheduler
    holds back a request whose adapter would make one more) also get --max-cpu-loras, one
    per adapter: vLLM's host-memory cache of loaded adapters is max_loras by default
    (config/lora.py), and its LRU would drop the others, to be read again from their
    paths whenever asked for (lora/worker_manager.py add_adapter). Host memory only, taken
    as each adapter is loaded; the GPU slots stay max_loras. Fixed at start, like the
    rest: adapters added to a running engine beyond it are still served, read again when
    dropped, until its next start."""
    if not spec.max_loras:
        return ()
    flags: tuple[str, ...] = ("--enable-lora", "--max-loras", str(spec.max_loras),
                              "--max-lora-rank", str(spec.max_lora_rank))
    if len(spec.adapters) > spec.max_loras:
        flags += ("--max-cpu-loras", str(len(spec.adapters)))
    return flags


def _serving(spec: EngineSpec, config: AgentConfig) -> tuple[str, ...]:
    return (
        "--host", config.mgmt_addr,
        "--port", str(spec.port),
        "--served-model-name", spec.served_name,
    )  # fmt: skip


def single_node_argv(engine: tuple[str, ...], spec: EngineSpec, config: AgentConfig) -> tuple[str, ...]:
    return (
        *engine, "serve", spec.model,
        *_serving(spec, config),
        *lora_flags(spec),
        "--tensor-parallel-size", str(spec.tensor_parallel),
        *spec.args,
    )  # fmt: skip


def mp_argv(
    engine: tuple[str, ...], spec: EngineSpec, gang: GangSpec, config: AgentConfig
) -> tuple[str, ...]:
    head = gang.rank == 0
    # LoRA on every rank: a headless rank builds its workers from its own argv (vLLM's
    # run_headless: AsyncEngineArgs.from_cli_args), and a worker without lora_config
    # fails the first LoRA batch or adapter load ("LoRA is not enabled").
    return (
        *engine, "serve", spec.model,
        *(_serving(spec, config) if head else ()),
        *lora_flags(spec),
        "--tensor-parallel-size", str(spec.tensor_parallel),
        "--pipeline-parallel-size", str(gang.nnodes),
        "--distributed-executor-backend", "mp",
        "--nnodes", str(gang.nnodes),
        "--node-rank", str(gang.rank),
        "--master-addr", gang.head_addr,
        "--master-port", str(gang.rendezvous_port),
        *(() if head else ("--headless",)),
        *spec.args,
    )  # fmt: skip


def ray_serve_argv(
    engine: tuple[str, ...], spec: EngineSpec, gang: GangSpec, config: AgentConfig
) -> tuple[str, ...]:
    return (
        *engine, "serve", spec.model,
        *_serving(spec, config),
        *lora_flags(spec),
        "--tensor-parallel-size", str(spec.tensor_parallel),
        "--pipeline-parallel-size", str(gang.nnodes),
        "--distributed-executor-backend", "ray",
        *spec.args,
    )  # fmt: skip


def vllm_plan(
    engine: tuple[str, ...],
    spec: EngineSpec,
    config: AgentConfig,
    env: dict[str, str],
    cwd: str,
    overrides: tuple[str, ...],
    *,
    download_dir: str = "",
) -> LaunchPlan:
    """`download_dir`: where vLLM fetches weights it must download (`--download-dir`,
    its weight files' cache_dir; HF_HUB_CACHE in `env` takes config and tokenizer there
    too). Before the deployment's args, so that its own --download-dir wins."""
    if download_dir:
        spec = evolve(spec, args=("--download-dir", download_dir, *spec.args))
    if spec.max_loras and RUNTIME_LORA_ENV not in env:
        env = {**env, RUNTIME_LORA_ENV: "True"}
    if spec.sleep_mode:
        # On every rank (the workers hold the memory it frees), and the endpoints with it:
        # the flag alone frees nothing anyone can ask for, so this env wins over the
        # deployment's own.
        spec = evolve(spec, args=(SLEEP_FLAG, *spec.args))
        env = {**env, DEV_MODE_ENV: "1"}
    if kv_events.publishes(spec):
        # Before the deployment's args, as --download-dir is; one of its own is refused at
        # apply (agent/engines/kv_events.py says why).
        spec = evolve(spec, args=(kv_events.FLAG, kv_events.vllm_config(spec), *spec.args))
    gang = spec.gang
    if gang is None or gang.nnodes <= 1:
        argv = single_node_argv(engine, spec, config)
        return LaunchPlan((ProcessPlan("engine", argv, env, cwd),), env_overrides=overrides)
    mode = config.engines.vllm.launch_mode
    if mode == "mp":
        argv = mp_argv(engine, spec, gang, config)
        return LaunchPlan(
            (ProcessPlan("engine", argv, env, cwd),),
            health_checked=gang.rank == 0,
            env_overrides=overrides,
        )
    if mode != "ray":
        raise ConfigError(
            config.source or "agent config",
            "engines.vllm.launch_mode",
            f"{mode!r} is not one of {', '.join(LAUNCH_MODES)}",
        )
    return _ray_plan(engine, spec, gang, config, env, cwd, overrides)


def _ray_plan(
    engine: tuple[str, ...],
    spec: EngineSpec,
    gang: GangSpec,
    config: AgentConfig,
    env: dict[str, str],
    cwd: str,
    overrides: tuple[str, ...],
) -> LaunchPlan:
    if not gang.ray_port or not gang.ray_port_base:
        raise EngineError(
            f"replica {spec.replica_id}: launch_mode ray needs the gang's ray_port and "
            f"ray_port_base (got {gang.ray_port} and {gang.ray_port_base})"
        )
    temp_dir = ray_temp_dir(cwd)
    start = ray_start_argv(gang, config, temp_dir, num_gpus=len(spec.gpus))
    name = "ray-head" if gang.rank == 0 else "ray-worker"
    # Ray >= 2.5x drains a node for 30 s on SIGTERM (for Ray Serve): the supervisor stops
    # the whole gang, so that wait would only eat stop_timeout and end in SIGKILL.
    ray_env = {RAY_DRAIN_ENV: "0", **env}
    ray_proc = ProcessPlan(name, start, ray_env, cwd)
    if gang.rank != 0:
        return LaunchPlan((ray_proc,), health_checked=False, env_overrides=overrides)
    # With its own --temp-dir, `ray.init(address="auto")` cannot find this cluster:
    # tell vllm serve where it is, unless the deployment already did.
    serve_env = {"RAY_ADDRESS": ray_address(gang), **env}
    serve = ProcessPlan("engine", ray_serve_argv(engine, spec, gang, config), serve_env, cwd)
    return LaunchPlan(
        (ray_proc, serve),
        wait_for_ray_nodes=gang.nnodes,
        ray_address=ray_address(gang),
        ray_status_argv=ray_status_argv(gang, config),
        env_overrides=overrides,
    )

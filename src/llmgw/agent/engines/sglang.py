"""SGLang launch plans: `python -m sglang.launch_server`, its documented entry point.

Flags checked against the SGLang documentation (server arguments, multi-node
deployment; v0.4/v0.5): `--model-path --served-model-name --host --port --tp`, and for
several nodes the same command on every node with `--nnodes N --node-rank R
--dist-init-addr HEAD:PORT`. SGLang's `--tp` is the tensor-parallel size of the whole
replica across its nodes, so a multi-node replica passes the per-node size times nnodes.

Ports (sglang 0.5.23, srt/server_args.py PortArgs.init_new): with the spec's engine block
(EngineSpec.port_base) SGLang gets `--nccl-port` from it (else it draws one at random in
22000-29999, inside llmgw's usual port range), and `--dist-init-addr` on one node too, from
the block, with room for the six ports after it that --enable-dp-attention binds (without
it, one node puts them at --port + 233, outside anything reserved). A gang's dist-init port
is the head's rendezvous port, which placement puts at the same place in the head's block.

Weights (llmgw.agent.engines.weights): `--model-path` is the copy's path where the node
holds one. A download goes into the agent's download_dir twice over, as with vLLM:
`--download-dir` (SGLang 0.5.23's model fields, srt/arg_groups/fields/model.py
`download_dir`, which load_model_utils.py hands to LoadConfig as the weights' cache_dir)
and HF_HUB_CACHE (build_plan), which takes the config and tokenizer there too.

LoRA (sglang 0.5.23, srt/arg_groups/fields/lora.py): `--enable-lora --max-lora-rank R
--max-loras-per-batch N --lora-paths NAME=PATH ...`. SGLang's batch limit counts the
base-only requests as one adapter, so it gets the deployment's max_loras plus one. The
adapters are given at start and never loaded at runtime: SGLang 0.5.23 has
/load_lora_adapter, but without --lora-paths it must be told --lora-target-modules up
front, which llmgw cannot know, and no SGLang engine runs in the test tiers to check it
on. A change of adapters therefore rolls an SGLang deployment (Deployment.template_hash).

KV-cache events (agent/engines/kv_events.py): the same `--kv-events-config` as vLLM's,
parsed by SGLang 0.5.23 into its own pydantic KVEventsConfig
(srt/disaggregation/kv_events.py), which differs from vLLM's: no enable_kv_cache_events
(unknown keys are ignored; the flag itself turns events on), publisher "null" by default
(so llmgw names "zmq"), a `bind` key and "0.0.0.0" also read as bind, a `format`
("default", or "dynamo" whose block hashes fold in extra_key and cache_salt), and its
BlockStored has no `extra_keys` (cache_salt and session_id instead). It goes after
SGLang's own flags and before the deployment's args, on rank 0 only.
"""

from __future__ import annotations

from attrs import evolve

from llmgw.agent.engines import kv_events
from llmgw.agent.engines.plan import LaunchPlan, ProcessPlan
from llmgw.config.agent import AgentConfig
from llmgw.model.deployment import SGLANG_DIST_INIT, SGLANG_NCCL_PORT
from llmgw.model.engine import EngineSpec


def sglang_argv(spec: EngineSpec, config: AgentConfig) -> tuple[str, ...]:
    gang = spec.gang
    multi = gang is not None and gang.nnodes > 1
    tp = spec.tensor_parallel * (gang.nnodes if gang is not None and multi else 1)
    argv: tuple[str, ...] = (
        config.engines.sglang.python, "-m", "sglang.launch_server",
        "--model-path", spec.model,
        "--served-model-name", spec.served_name,
        "--host", config.mgmt_addr,
        "--port", str(spec.port),
        "--tp-size", str(tp),
        # SGLang serves /metrics only with this; its running and queued counts are what a
        # drain waits on (agent/lifecycle/inflight.py) and what the router balances by.
        "--enable-metrics",
    )  # fmt: skip
    if spec.port_base:
        argv += ("--nccl-port", str(spec.port_base + SGLANG_NCCL_PORT))
    if gang is not None and multi:
        argv += (
            "--nnodes", str(gang.nnodes),
            "--node-rank", str(gang.rank),
            "--dist-init-addr", f"{gang.head_addr}:{gang.rendezvous_port}",
        )  # fmt: skip
    elif spec.port_base:
        argv += ("--dist-init-addr", f"{config.mgmt_addr}:{spec.port_base + SGLANG_DIST_INIT}")
    return argv + lora_argv(spec) + spec.args


def lora_argv(spec: EngineSpec) -> tuple[str, ...]:
    if not spec.max_loras:
        return ()
    argv: tuple[str, ...] = ("--enable-lora", "--max-lora-rank", str(spec.max_lora_rank),
                             "--max-loras-per-batch", str(spec.max_loras + 1))
    if spec.adapters:
        argv += ("--lora-paths", *(f"{a.name}={a.path}" for a in spec.adapters))
    return argv


def sglang_plan(
    spec: EngineSpec,
    config: AgentConfig,
    env: dict[str, str],
    cwd: str,
    overrides: tuple[str, ...],
    *,
    download_dir: str = "",
) -> LaunchPlan:
    """`download_dir`: where SGLang fetches weights it must download (`--download-dir`),
    before the deployment's args, so that its own --download-dir wins."""
    if download_dir:
        spec = evolve(spec, args=("--download-dir", download_dir, *spec.args))
    if kv_events.publishes(spec):
        spec = evolve(spec, args=(kv_events.FLAG, kv_events.sglang_config(spec), *spec.args))
    # Ranks other than 0 run a dummy health server that always says 200: liveness only.
    rank0 = spec.gang is None or spec.gang.rank == 0
    return LaunchPlan(
        (ProcessPlan("engine", sglang_argv(spec, config), env, cwd),),
        health_checked=rank0,
        env_overrides=overrides,
    )

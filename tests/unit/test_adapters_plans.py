"""LoRA in the launch plans: vLLM starts with LoRA enabled and runtime updating allowed
(the agent loads the adapters); SGLang is given them at start."""

from __future__ import annotations

import attrs

from llmgw.agent.engines import build_plan
from llmgw.agent.engines.vllm import RUNTIME_LORA_ENV
from llmgw.config.agent import AgentConfig, EnginesConfig, KeysConfig, SglangConfig, VllmConfig
from llmgw.model.engine import Adapter, EngineKind, EngineSpec, GangSpec

ADAPTERS = (Adapter("llama-sql", "/models/sql"), Adapter("llama-chat", "/models/chat"))
IDX = {"GPU-aaaa": 3}
WORK = "/var/lib/llmgw-agent"


def config(mode: str = "mp", simulated_python: str = "") -> AgentConfig:
    return AgentConfig(node_id="n1", server="tcp://10.0.0.9:5555", keys=KeysConfig("s", "p"),
                       mgmt_addr="10.0.0.2",
                       engines=EnginesConfig(
                           vllm=VllmConfig(bin="/opt/vllm/bin/vllm", launch_mode=mode,
                                           ray_bin="/opt/vllm/bin/ray"),
                           sglang=SglangConfig(python="/opt/sglang/bin/python"),
                           simulated_python=simulated_python))


def spec(kind: EngineKind, rank: int | None = None) -> EngineSpec:
    gang = None if rank is None else GangSpec(2, rank, "10.0.0.1", 29600, ray_port=26379,
                                              ray_port_base=27000)
    return EngineSpec("r1", 1, "llama", "/models/llama", "llama", kind, ("GPU-aaaa",), 20001,
                      gang=gang)


def _lora(kind: EngineKind, rank: int | None = None) -> EngineSpec:
    return attrs.evolve(spec(kind, rank), adapters=ADAPTERS, max_loras=2, max_lora_rank=32)


def test_vllm_starts_with_lora_enabled_and_runtime_updating_allowed() -> None:
    plan = build_plan(_lora(EngineKind.VLLM), config(), WORK, gpu_indices=IDX)
    argv = plan.main.argv
    i = argv.index("--enable-lora")
    assert argv[i:i + 5] == ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "32")
    # Loaded by the agent once ready, never static: a bad static adapter stops vLLM's start.
    assert "--lora-modules" not in argv
    assert plan.main.env[RUNTIME_LORA_ENV] == "True"


def test_vllm_without_lora_is_unchanged() -> None:
    plan = build_plan(spec(EngineKind.VLLM), config(), WORK, gpu_indices=IDX)
    assert "--enable-lora" not in plan.main.argv and RUNTIME_LORA_ENV not in plan.main.env


def test_the_deployments_own_env_wins_over_runtime_updating() -> None:
    s = attrs.evolve(_lora(EngineKind.VLLM), env={RUNTIME_LORA_ENV: "0"})
    plan = build_plan(s, config(), WORK, gpu_indices=IDX)
    assert plan.main.env[RUNTIME_LORA_ENV] == "0"


def _lora_part(argv: tuple[str, ...]) -> tuple[str, ...]:
    i = argv.index("--enable-lora")
    return argv[i:i + 7]


def test_every_mp_rank_and_the_ray_head_get_the_same_lora_flags() -> None:
    """A headless rank builds its workers from its own argv (vLLM's run_headless): without
    the flags there, its workers have no lora_config and fail the first LoRA batch."""
    three = attrs.evolve(_lora(EngineKind.VLLM, rank=0), adapters=(*ADAPTERS, Adapter("c", "/models/c")))
    head = build_plan(three, config("mp"), WORK, gpu_indices=IDX)
    member = build_plan(attrs.evolve(three, gang=attrs.evolve(three.gang, rank=1)), config("mp"), WORK,
                        gpu_indices=IDX)
    ray = build_plan(three, config("ray"), WORK, gpu_indices=IDX)
    want = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "32", "--max-cpu-loras", "3")
    assert _lora_part(head.main.argv) == _lora_part(member.main.argv) == _lora_part(ray.main.argv) == want
    assert "--headless" in member.main.argv and "--host" not in member.main.argv  # still no API


def test_sglang_is_given_its_adapters_at_start() -> None:
    plan = build_plan(_lora(EngineKind.SGLANG), config(), WORK, gpu_indices=IDX)
    argv = plan.main.argv
    i = argv.index("--enable-lora")
    assert argv[i:i + 5] == ("--enable-lora", "--max-lora-rank", "32", "--max-loras-per-batch", "3")
    j = argv.index("--lora-paths")
    assert argv[j + 1:j + 3] == ("llama-sql=/models/sql", "llama-chat=/models/chat")
    assert RUNTIME_LORA_ENV not in plan.main.env


def test_the_simulated_engine_gets_vllms_lora_command_line() -> None:
    plan = build_plan(_lora(EngineKind.SIMULATED), config(simulated_python="/usr/bin/python3"), WORK,
                      gpu_indices=IDX)
    assert "--enable-lora" in plan.main.argv and plan.main.env[RUNTIME_LORA_ENV] == "True"

"""vLLM's API-server count and the runtime-LoRA refusal it implies, as llmgw predicts them
(config/vllm_serve.py). The same table runs through vLLM's own ServeSubcommand.cmd in the
real-engine tier (tests/real_engine/test_vllm_args.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmgw.config.deployment import parse_deployment
from llmgw.config.load_deployment import load_deployment
from llmgw.config.vllm_serve import api_server_count, apply_refusal, runtime_lora_refusal, takes_priority
from llmgw.errors import DeploymentError
from llmgw.model.deployment import Deployment
from llmgw.model.engine import EngineKind

# (deployment args, the API servers vLLM 0.32 runs). Shared with the real-engine tier.
CASES: list[tuple[list[str], int]] = [
    ([], 1),
    (["--api-server-count", "2"], 2),
    (["--api-server-count=3"], 3),
    (["-asc", "4"], 4),
    (["--api-server-count", "2", "--api-server-count", "1"], 1),  # the last one wins
    (["--data-parallel-size", "2"], 2),  # default: one per data-parallel rank
    (["-dp", "4"], 4),
    (["--data_parallel_size", "2"], 2),  # FlexibleArgumentParser's underscores
    (["--data-parallel-size", "4", "--api-server-count", "1"], 1),
    (["--data-parallel-size", "4", "--data-parallel-external-lb"], 1),
    (["--data-parallel-size", "4", "--data-parallel-rank", "1"], 1),
    (["--data-parallel-size", "4", "--data-parallel-size-local", "2", "--data-parallel-hybrid-lb"], 2),
    (["--data-parallel-size", "4", "--data-parallel-size-local", "2", "--data-parallel-start-rank", "0"], 2),
    (["--data-parallel-size", "4", "--data-parallel-size-local", "2", "--data-parallel-start-rank", "0",
      "--no-data-parallel-hybrid-lb"], 2),  # the start rank still means hybrid
    (["--data-parallel-size", "4", "--data-parallel-hybrid-lb"], 1),  # no local size: 1
    (["--data-parallel-size", "4", "--enable-elastic-ep"], 1),
    (["--headless"], 0),
]


@pytest.mark.parametrize(("args", "count"), CASES)
def test_api_server_count_follows_vllms_defaults(args: list[str], count: int) -> None:
    assert api_server_count(args) == count


def test_runtime_lora_is_refused_with_several_api_servers_only() -> None:
    assert runtime_lora_refusal(["--api-server-count", "2"], {}, lora_slots=0) == ""  # no LoRA
    assert runtime_lora_refusal([], {}, lora_slots=2) == ""
    why = runtime_lora_refusal(["--data-parallel-size", "2"], {}, lora_slots=2)
    assert "2 API server processes" in why and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in why
    # The deployment's own env turning runtime updating off wins (vLLM reads "1"/"true").
    assert runtime_lora_refusal(["-asc", "2"], {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"}, 2) == ""
    assert runtime_lora_refusal(["-asc", "2"], {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": " TRUE "}, 0)


BASE = {"name": "llama", "model": "/models/llama", "engine": "vllm", "gpus_per_node": 1,
        "replicas": 1, "max_loras": 2, "args": ["--api-server-count", "2"]}


def test_apply_refuses_the_combination_naming_the_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "llama.yaml"
    path.write_text(yaml.safe_dump(BASE))
    with pytest.raises(DeploymentError) as e:
        load_deployment(str(path))
    assert str(path) in str(e.value) and "args" in str(e.value) and "--api-server-count 1" in str(e.value)
    # A stored deployment is read back as it was (the server must load older state) ...
    d = parse_deployment(BASE, "the state database")
    assert apply_refusal(d)
    # ... and other engines are not vLLM's business.
    assert apply_refusal(parse_deployment({**BASE, "engine": "sglang"}, "x")) == ""
    assert apply_refusal(parse_deployment({**BASE, "args": []}, "x")) == ""


@pytest.mark.parametrize(("engine", "args", "takes"), [
    ("vllm", [], False),  # vLLM's default policy, fcfs: the field is ignored
    ("vllm", ["--scheduling-policy", "priority"], True),
    ("vllm", ["--scheduling_policy=priority"], True),  # FlexibleArgumentParser's underscores
    ("vllm", ["--scheduling-policy", "priority", "--scheduling-policy", "fcfs"], False),  # the last wins
    ("vllm", ["--scheduling-policy", "fcfs"], False),
    ("sglang", ["--scheduling-policy", "priority"], False),  # not SGLang's flag
])
def test_takes_priority(engine: str, args: list[str], takes: bool) -> None:
    d = Deployment(name="d", model="org/m", engine=EngineKind(engine), gpus_per_node=1, replicas=1,
                   args=tuple(args))
    assert takes_priority(d) is takes

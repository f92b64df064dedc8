"""llmgw's SGLang launch plans against SGLang's own server-args parser (checked with
sglang 0.5.23). SGLang cannot be installed whole here (its deps pull CUDA builds), but its
parser imports without a GPU given torch and numpy from the vLLM venv:

    LLMGW_SGLANG_PATH=$(tests/real_engine/install_sglang_parser.sh) LLMGW_VLLM_VENV=... \
        pytest -m real_engine tests/real_engine/test_sglang_args.py

Skipped without LLMGW_SGLANG_PATH; with LLMGW_REQUIRE_REAL_ENGINE=1 (.ci/run) that fails."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from llmgw.agent.engines import build_plan
from llmgw.agent.engines.weights import Weights
from llmgw.config.agent import AgentConfig, EnginesConfig, KeysConfig, SglangConfig
from llmgw.model.engine import Adapter, EngineKind, EngineSpec, GangSpec

pytestmark = pytest.mark.real_engine
REQUIRE_ENV = "LLMGW_REQUIRE_REAL_ENGINE"  # as conftest.py: a skip here is then a failure
HERE = Path(__file__).resolve().parent


def _argvs() -> dict[str, list[str]]:
    cfg = AgentConfig(node_id="n1", server="tcp://10.0.0.9:5555", keys=KeysConfig("s", "p"),
                      mgmt_addr="10.0.0.2",
                      engines=EnginesConfig(sglang=SglangConfig(python="/opt/sglang/bin/python")))
    out = {}
    # "-block": with the engine port block (--nccl-port, and --dist-init-addr on one node).
    for name, rank, base in (("single", None, 0), ("rank0", 0, 0), ("rank1", 1, 0),
                             ("single-block", None, 20100), ("rank0-block", 0, 20100)):
        gang = None if rank is None else GangSpec(2, rank, "10.0.0.1", 29600)
        spec = EngineSpec("r1", 1, "q", "/models/qwen", "qwen", EngineKind.SGLANG, ("GPU-a",), 20001,
                          tensor_parallel=4, args=("--mem-fraction-static", "0.85"), gang=gang,
                          port_base=base)
        argv = build_plan(spec, cfg, "/w", gpu_indices={"GPU-a": 0}).main.argv
        assert argv[1:3] == ("-m", "sglang.launch_server")
        out[name] = list(argv[3:])
    lora = EngineSpec("r1", 1, "q", "/models/qwen", "qwen", EngineKind.SGLANG, (), 20001,
                      adapters=(Adapter("qwen-sql", "/models/sql"), Adapter("qwen-chat", "/models/chat")),
                      max_loras=2, max_lora_rank=32, args=("--mem-fraction-static", "0.85"))
    out["lora"] = list(build_plan(lora, cfg, "/w", gpu_indices={}).main.argv[3:])
    # No copy on the node: SGLang downloads into the agent's download_dir.
    fetch = EngineSpec("r1", 1, "q", "org/qwen", "qwen", EngineKind.SGLANG, (), 20001)
    weights = Weights("org/qwen", {"HF_HUB_CACHE": "/data/models"}, download_dir="/data/models")
    out["download"] = list(build_plan(fetch, cfg, "/w", gpu_indices={}, weights=weights).main.argv[3:])
    events = EngineSpec("r1", 1, "q", "/models/qwen", "qwen", EngineKind.SGLANG, (), 20001,
                        port_base=20100, kv_events=True)
    out["kv-events"] = list(build_plan(events, cfg, "/w", gpu_indices={}).main.argv[3:])
    return out


@pytest.fixture(scope="module")
def parsed(vllm_venv: Path) -> dict[str, dict]:
    path = os.environ.get("LLMGW_SGLANG_PATH", "")
    if not path:
        problem = ("SGLang parser check: set LLMGW_SGLANG_PATH="
                   "$(tests/real_engine/install_sglang_parser.sh)")
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {problem}", pytrace=False)
        pytest.skip(problem)
    argvs = _argvs()
    r = subprocess.run([str(vllm_venv / "bin" / "python"), str(HERE / "sglang_args_check.py")],
                       input=json.dumps(list(argvs.values())), capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": path})
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(zip(argvs, json.loads(r.stdout), strict=True))


def test_sglang_plans_parse(parsed: dict[str, dict]) -> None:
    for name, res in parsed.items():
        assert res["ok"], (name, res)
        assert res["args"]["enable_metrics"] is True, name  # /metrics: drains and load reads
    assert parsed["single"]["args"]["tp_size"] == 4
    # One node with the block: the dist-init port (and the six after it that dp attention
    # binds) come from the block, not from --port + 233.
    assert parsed["single-block"]["args"]["dist_init_addr"] == "10.0.0.2:20101"
    assert parsed["rank0-block"]["args"]["dist_init_addr"] == "10.0.0.1:29600"
    for rank in (0, 1):
        a = parsed[f"rank{rank}"]["args"]
        assert (a["tp_size"], a["nnodes"], a["node_rank"], a["dist_init_addr"]) == (8, 2, rank, "10.0.0.1:29600")
        assert a["host"] == "10.0.0.2" and a["served_model_name"] == "qwen"


def test_sglang_lora_plan_parses_as_the_adapters(parsed: dict[str, dict]) -> None:
    a = parsed["lora"]["args"]
    assert a["enable_lora"] is True and a["max_lora_rank"] == 32
    assert a["max_loras_per_batch"] == 3  # SGLang counts the base-only requests as one
    # SGLang's LoRAPathAction keeps NAME=PATH as its LoRARef list (or a dict, by version).
    text = json.dumps(a["lora_paths"], default=str)
    assert "qwen-sql" in text and "/models/sql" in text and "qwen-chat" in text, text


def test_sglang_downloads_into_the_agents_download_dir(parsed: dict[str, dict]) -> None:
    assert parsed["download"]["args"]["download_dir"] == "/data/models"
    assert parsed["download"]["args"]["model_path"] == "org/qwen"


def test_sglang_plans_use_exact_flags(parsed: dict[str, dict]) -> None:
    for name, res in parsed.items():
        assert res["inexact"] == [], (name, res["inexact"])


def test_sglang_reads_llmgws_kv_events_config(parsed: dict[str, dict]) -> None:
    """SGLang's own KVEventsConfig from the plan's JSON: the zmq publisher (its default is
    "null"), loopback ports of the block, connected to (no bind), the replica id as topic."""
    cfg = parsed["kv-events"]["kv_events"]
    assert (cfg["publisher"], cfg["topic"], cfg["bind"]) == ("zmq", "r1", None)
    assert (cfg["endpoint"], cfg["replay_endpoint"]) == ("tcp://127.0.0.1:20113", "tcp://127.0.0.1:20114")
    assert "kv_events" not in parsed["single-block"]

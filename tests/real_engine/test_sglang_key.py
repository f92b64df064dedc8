"""SGLang reads the key llmgw writes for it (issue 30 item 2), checked with SGLang's own
parser (sglang 0.5.23's prepare_server_args, which merges a --config YAML into its argv):
the plan's argv with its --config file gives `api_key` the engine's key, and nothing of
the key is on the command line.

    LLMGW_SGLANG_PATH=$(tests/real_engine/install_sglang_parser.sh) LLMGW_VLLM_VENV=... \\
        pytest -m real_engine tests/real_engine/test_sglang_key.py

Skipped without LLMGW_SGLANG_PATH; with LLMGW_REQUIRE_REAL_ENGINE=1 (.ci/run) that fails."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from llmgw.agent.engines.keys import sglang_key_config
from llmgw.agent.lifecycle.records import new_key
from llmgw.agent.process.spawn import default_plan, write_secret
from llmgw.config.agent import AgentConfig, EnginesConfig, KeysConfig, SglangConfig, SupervisorConfig
from llmgw.model.engine import EngineKind, EngineSpec, GangSpec

pytestmark = pytest.mark.real_engine
REQUIRE_ENV = "LLMGW_REQUIRE_REAL_ENGINE"

CHECK = """
import json, sys
from sglang.srt.server_args import prepare_server_args
print(json.dumps(prepare_server_args(json.loads(sys.argv[1])).api_key))
"""


@pytest.mark.parametrize("rank", [None, 0])
def test_sglang_takes_the_key_from_the_config_file_llmgw_writes(
        vllm_venv: Path, tmp_path: Path, rank: int | None) -> None:
    path = os.environ.get("LLMGW_SGLANG_PATH", "")
    if not path:
        problem = "SGLang parser check: set LLMGW_SGLANG_PATH=$(tests/real_engine/install_sglang_parser.sh)"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {problem}", pytrace=False)
        pytest.skip(problem)
    cfg = AgentConfig(node_id="n1", server="tcp://10.0.0.9:5555", keys=KeysConfig("s", "p"),
                      mgmt_addr="10.0.0.2", supervisor=SupervisorConfig(work_dir=str(tmp_path)),
                      engines=EnginesConfig(sglang=SglangConfig(python="/opt/sglang/bin/python")))
    gang = None if rank is None else GangSpec(2, rank, "10.0.0.1", 29600)
    spec = EngineSpec("r1", 1, "q", "/models/qwen", "qwen", EngineKind.SGLANG, ("GPU-a",), 20001,
                      tensor_parallel=1, gang=gang)
    plan = default_plan(cfg, "/usr/bin/python3")(spec, {"GPU-a": 0})
    key = new_key()
    os.makedirs(os.path.dirname(plan.api_key_file), exist_ok=True)
    write_secret(plan.api_key_file, sglang_key_config(key))  # as spawn_plan does
    argv = list(plan.main.argv[3:])  # after `python -m sglang.launch_server`
    assert key not in " ".join(argv)
    r = subprocess.run([str(vllm_venv / "bin" / "python"), "-c", CHECK, json.dumps(argv)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path})
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == key

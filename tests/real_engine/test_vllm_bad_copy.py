"""vLLM's CPU build on a copy the storage scan counts complete but whose weights file is
truncated (issue 23): vLLM dies loading it, in words the agent recognises; the node then
reports the copy incomplete with them and offers it no more (the restart downloads, which
offline fails: the copy is not taken again).

One engine start that fails; every process started here is killed by pid at the end.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fakes.live import Cluster, wait_for
from fakes.nvidia_smi import L40S, L40S_BUS, query_line, topo_matrix, write_script
from llmgw.agent.bad_copies import unreadable_reason

pytestmark = pytest.mark.real_engine

FAIL_TIMEOUT = 300
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
ENGINE_ARGS = ["--max-model-len", "512", "--enforce-eager"]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, heartbeat="1s", lost_after="60s")
    try:
        yield c
    finally:
        c.close()


def _copy(c: Cluster) -> dict[str, Any]:
    r = c.ctl("describe", "node", "cpu-1", "-o", "json")
    assert r.returncode == 0, r.stderr
    (m,) = [m for m in json.loads(r.stdout)["storage"]["models"] if m["name"] == "org/tiny"]
    return m  # type: ignore[no-any-return]


def test_vllm_dies_on_a_truncated_copy_and_the_node_stops_offering_it(
        cluster: Cluster, vllm_venv: Path, tiny_model: Path, tmp_path: Path) -> None:
    models = tmp_path / "models"
    copy = models / "org" / "tiny"
    shutil.copytree(tiny_model, copy)
    weights = copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # a copy that died half way
    smi = write_script(tmp_path / "smi", query_line(0, L40S, L40S_BUS[0], 46068, 46068, "8.9") + "\n",
                       topo_matrix([["X"]], ["0"]))
    cluster.start_server()
    cluster.start_agent(
        "cpu-1", discovery={"nvidia_smi": str(smi)},
        engines={"vllm": {"bin": str(vllm_venv / "bin" / "vllm"), "launch_mode": "mp"}},
        model_dirs=[str(models)], download_dir=str(tmp_path / "downloads"))
    cluster.wait_states({"cpu-1": "ready"})
    assert _copy(cluster)["complete"]  # the scan sees every file there
    dep = tmp_path / "tiny.yaml"
    dep.write_text(
        "name: tiny\nmodel: org/tiny\nengine: vllm\ngpus_per_node: 1\nreplicas: 1\n"
        f"startup_timeout: {FAIL_TIMEOUT}s\nargs: {json.dumps(ENGINE_ARGS)}\n"
        f"env: {json.dumps(ENGINE_ENV)}\n")
    t0 = time.monotonic()
    assert cluster.ctl("apply", "-f", str(dep)).returncode == 0
    log = tmp_path / "agents" / "cpu-1" / "work" / "engines" / "tiny-0" / "engine.log"
    wait_for(lambda: not _copy(cluster)["complete"], FAIL_TIMEOUT,
             f"the truncated copy reported (log: {log})", interval=1.0)
    print(f"vLLM died on the truncated copy and the node reported it in {time.monotonic() - t0:.0f}s")
    reason = _copy(cluster)["reason"]
    assert reason.startswith("the engine could not read it: "), reason
    text = log.read_text(errors="replace")
    first = text.split("weights org/tiny:")[1]
    assert unreadable_reason(first.splitlines()), first[-3000:]
    print(f"vLLM's words: {reason}")

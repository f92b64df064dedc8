"""vLLM's CPU build on a copy the storage scan counts complete but whose weights file is
truncated (issue 23): vLLM dies loading it, in words the agent recognises; the node then
reports the copy incomplete with them and offers it no more (the restart downloads, which
offline fails: the copy is not taken again).

One engine start that fails; every process started here is killed by pid at the end.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from fakes.live import Cluster, wait_for
from fakes.nvidia_smi import L40S, L40S_BUS, query_line, topo_matrix, write_script
from fakes.vllm_rig import engine_log, node_copy, tiny_yaml, vllm_agent
from llmgw.agent.lifecycle.bad_copies import unreadable_reason

pytestmark = pytest.mark.real_engine

FAIL_TIMEOUT = 300


def _copy(c: Cluster) -> dict[str, Any]:
    (m,) = [m for m in c.ok_json("describe", "node", "cpu-1")["storage"]["models"]
            if m["name"] == "org/tiny"]
    return m  # type: ignore[no-any-return]


def test_vllm_dies_on_a_truncated_copy_and_the_node_stops_offering_it(
        cluster: Cluster, vllm_venv: Path, tiny_model: Path, tmp_path: Path) -> None:
    models = node_copy(tiny_model, tmp_path)
    weights = models / "org" / "tiny" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # a copy that died half way
    smi = write_script(tmp_path / "smi", query_line(0, L40S, L40S_BUS[0], 46068, 46068, "8.9") + "\n",
                       topo_matrix([["X"]], ["0"]))
    cluster.up({"cpu-1": vllm_agent(vllm_venv, smi, models,
                                    download_dir=str(tmp_path / "downloads"))})
    assert _copy(cluster)["complete"]  # the scan sees every file there
    t0 = time.monotonic()
    cluster.apply("tiny", tiny_yaml(timeout=FAIL_TIMEOUT))
    log = engine_log(tmp_path)
    wait_for(lambda: not _copy(cluster)["complete"], FAIL_TIMEOUT,
             f"the truncated copy reported (log: {log})", interval=1.0)
    print(f"vLLM died on the truncated copy and the node reported it in {time.monotonic() - t0:.0f}s")
    reason = _copy(cluster)["reason"]
    assert reason.startswith("the engine could not read it: "), reason
    text = log.read_text(errors="replace")
    first = text.split("weights org/tiny:")[1]
    assert unreadable_reason(first.splitlines()), first[-3000:]
    print(f"vLLM's words: {reason}")

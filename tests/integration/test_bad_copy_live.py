"""A copy of weights that the storage scan counts complete but the engine cannot read
(issue 23): the engine dies starting, the node reports the copy incomplete with the
engine's words and stops offering it (the restart downloads instead), until a scan finds
the copy changed. Real server and agent processes, the simulated engine reading the
folder as vLLM's loader would (LLMGW_SIM_READ_WEIGHTS=1)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from fakes.live import Cluster, wait_for
from fakes.models import plain_model
from fakes.nvidia_smi import L40S, L40S_BUS, query_line, topo_matrix, write_script


def _idle_gpu(folder: Path) -> Path:
    """One L40S with all its memory free: an engine's exit releases it at once (a box with
    memory in use would hold its GPU as releasing after every exit)."""
    return write_script(folder, query_line(0, L40S, L40S_BUS[0], 46068, 46068, "8.9") + "\n",
                        topo_matrix([["X"]], ["0"]))


def _copy(c: Cluster) -> dict[str, Any]:
    r = c.ctl("describe", "node", "n1", "-o", "json")
    assert r.returncode == 0, r.stderr
    (m,) = [m for m in json.loads(r.stdout)["storage"]["models"] if m["name"] == "org/tiny"]
    return m  # type: ignore[no-any-return]


def _replica(c: Cluster) -> dict[str, Any]:
    r = c.ctl("get", "replica", "tiny-0", "-o", "json")
    return json.loads(r.stdout) if r.returncode == 0 else {}  # type: ignore[no-any-return]


def test_an_unreadable_copy_is_reported_and_not_chosen_again(cluster: Cluster, tmp_path: Path) -> None:
    models = tmp_path / "models"
    copy = plain_model(models, "org/tiny", shards=1, index=False)  # a placeholder shard
    cluster.start_server()
    cluster.start_agent("n1", discovery={"nvidia_smi": str(_idle_gpu(tmp_path / "smi"))},
                        model_dirs=[str(models)], download_dir=str(tmp_path / "downloads"))
    cluster.wait_states({"n1": "ready"})
    assert _copy(cluster)["complete"]
    dep = tmp_path / "tiny.yaml"
    dep.write_text("name: tiny\nmodel: org/tiny\nengine: simulated\ngpus_per_node: 1\n"
                   "replicas: 1\nenv: {LLMGW_SIM_READ_WEIGHTS: '1'}\n")
    assert cluster.ctl("apply", "-f", str(dep)).returncode == 0

    # The engine died reading it: the node says so, with the loader's words.
    wait_for(lambda: not _copy(cluster)["complete"], 40, "the copy reported unreadable", interval=0.5)
    reason = _copy(cluster)["reason"]
    assert reason.startswith("the engine could not read it: ") and "header too large" in reason, reason
    # The restart does not take it again: it downloads, and serves.
    wait_for(lambda: _replica(cluster).get("state") == "ready", 60, "tiny-0 ready on a download",
             interval=0.5)
    log = next((tmp_path / "agents" / "n1" / "work").rglob("engine.log")).read_text()
    assert f"weights org/tiny: local plain tree {copy}" in log  # the first start took it
    assert "downloading into" in log.rsplit("weights org/tiny", 1)[1]
    described = cluster.ctl("describe", "replica", "tiny-0").stdout
    assert "which this node no longer offers" in described, described
    # Copied again, whole: the next scan finds it changed and the node offers it again.
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (shard,) = copy.glob("*.safetensors")
    shard.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    assert cluster.ctl("rediscover", "n1").returncode == 0
    wait_for(lambda: _copy(cluster)["complete"], 30, "the copy offered again", interval=0.5)

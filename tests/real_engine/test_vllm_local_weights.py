"""vLLM's CPU build starts on the weights the node holds (issue 23): the deployment names
the model by id (`org/tiny`), the agent's model_dirs hold it as a plain tree, and the
engine runs with no network (HF_HUB_OFFLINE=1). Before issue 23 the agent handed vLLM the
id, which offline fails ("We couldn't connect to huggingface.co" / not a local folder).

One engine start; every process started here is killed by pid at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from fakes.engine_keys import auth, url_key
from fakes.live import Cluster, wait_for
from fakes.nvidia_smi import pcie_box
from fakes.vllm_rig import READY_TIMEOUT, engine_log, leaders, node_copy, tiny_yaml, vllm_agent
from llmgw.agent.engines import build_plan, weights_for
from llmgw.config.agent import AgentConfig, EnginesConfig, KeysConfig, ModelDirConfig, VllmConfig
from llmgw.model.engine import EngineKind, EngineSpec
from llmgw.model.inventory import ModelCopy, StorageReport

pytestmark = pytest.mark.real_engine

HERE = Path(__file__).resolve().parent


def _replica(c: Cluster) -> dict[str, object]:
    return next(iter(c.replicas().values()), {})


def test_deployment_by_id_runs_on_the_nodes_copy_offline(
        cluster: Cluster, vllm_venv: Path, tiny_model: Path, tmp_path: Path) -> None:
    models = node_copy(tiny_model, tmp_path)
    copy = models / "org" / "tiny"
    cluster.up({"cpu-1": vllm_agent(vllm_venv, pcie_box(tmp_path / "smi"), models)})
    cluster.apply("tiny", tiny_yaml())
    log = engine_log(tmp_path)
    t0 = time.monotonic()

    def ready() -> dict[str, object] | None:
        rep = _replica(cluster)
        return rep if rep.get("state") == "ready" else None

    rep = wait_for(ready, READY_TIMEOUT, f"vLLM ready on the node's copy (log: {log})", interval=1.0)
    print(f"vLLM ready on the local copy in {time.monotonic() - t0:.0f}s")
    text = log.read_text(errors="replace")
    assert f"llmgw agent: weights org/tiny: local plain tree {copy}" in text
    # vLLM was given the copy's path, not the id.
    (leader,) = leaders(tmp_path)
    argv = Path(f"/proc/{leader}/cmdline").read_bytes().split(b"\0")
    assert str(copy).encode() in argv and b"org/tiny" in argv  # the path; the served name
    assert argv[argv.index(b"--served-model-name") + 1] == b"org/tiny"
    # Clients see the deployment's name.
    req = urllib.request.Request(f"{rep['endpoint']}/v1/models", headers=auth(url_key(rep["endpoint"])))
    with urllib.request.urlopen(req, timeout=30) as resp:
        served = [m["id"] for m in json.load(resp)["data"]]
    assert served == ["org/tiny"]


def test_weights_flags_and_env_are_what_vllm_and_the_hub_read(vllm_venv: Path) -> None:
    """The download plan's --download-dir parses with vLLM's own serve parser, and the
    variables the plans set are the ones huggingface_hub (which vLLM and SGLang load
    through) reads: no network, and the cache folder the next scan looks in."""
    cfg = AgentConfig(node_id="n1", server="tcp://10.0.0.9:5555", keys=KeysConfig("s", "p"),
                      mgmt_addr="127.0.0.1", model_dirs=(ModelDirConfig("/data/models"),),
                      engines=EnginesConfig(vllm=VllmConfig(bin="vllm", launch_mode="mp")))
    spec = EngineSpec("r1", 1, "tiny", "org/tiny", "tiny", EngineKind.VLLM, (), 20001,
                      args=("--max-model-len", "512"))
    hf = StorageReport(True, (ModelCopy("org/tiny", "/hub/models--org--tiny/snapshots/r1", 9, True),))
    plans = {node: build_plan(spec, cfg, "/w", gpu_indices={},
                              weights=weights_for(spec, cfg, storage))
             for node, storage in (("nothing", StorageReport(True, ())), ("hf-cache", hf))}
    argv = list(plans["nothing"].main.argv[1:])
    assert "--download-dir" in argv
    r = subprocess.run([str(vllm_venv / "bin" / "python"), str(HERE / "vllm_args_check.py")],
                       input=json.dumps([argv]), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (parsed,) = json.loads(r.stdout)
    assert parsed["ok"], parsed
    assert parsed["args"]["model_tag"] == "org/tiny"
    read = ("import json, huggingface_hub.constants as c; "
            "print(json.dumps([c.HF_HUB_CACHE, c.HF_HUB_OFFLINE]))")
    for node, want in (("nothing", ["/data/models", False]), ("hf-cache", ["/hub", True])):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
        out = subprocess.run([str(vllm_venv / "bin" / "python"), "-c", read],
                             env={**env, **plans[node].main.env}, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout) == want, node

"""The pre-flight of a single-node tensor-parallel replica for real on CPU (issue 22): a
server and one agent on loopback, four simulated GPUs, a deployment of one node and two
GPUs with `preflight: required`. Before the engine starts, the agent runs llmgw's probe
with the vLLM CPU environment's Python (torch): two Gloo ranks on this one node (one per
placed GPU), meeting on 127.0.0.1, an all-reduce checked for correctness and timed. The
engine starts only after it passed; the figures are in its log, preflight.json and
`describe replica`. A replica of the same shape without the setting starts first, for the
time the probe adds to a start (printed, never asserted).

The engine is the simulated one, as in test_preflight_live.py: the probe is what is
tested, and `engines.preflight_python` names the vLLM environment's Python for it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from fakes.live import Cluster, wait_for

pytestmark = pytest.mark.real_engine


def test_one_node_two_gpus_pass_the_gloo_preflight_before_the_engine_starts(
        tmp_path: Path, vllm_venv: Path) -> None:
    c = Cluster(tmp_path, heartbeat="1s", lost_after="60s")

    def replicas() -> dict[str, dict[str, object]]:
        r = c.ctl("get", "replicas", "-o", "json")
        assert r.returncode == 0, r.stderr
        return {x["id"]: x for x in json.loads(r.stdout)}

    def ready_after(name: str, extra: str) -> float:
        f = tmp_path / f"{name}.yaml"
        f.write_text(f"name: {name}\nmodel: org/{name}\nengine: simulated\ngpus_per_node: 2\n"
                     f"replicas: 1\n{extra}")
        t0 = time.monotonic()
        r = c.ctl("apply", "-f", str(f))
        assert r.returncode == 0, r.stderr
        wait_for(lambda: replicas().get(f"{name}-0", {}).get("state") == "ready", 90, f"{name}-0 ready")
        return time.monotonic() - t0

    try:
        c.start_server()
        c.start_agent("a1", discovery={"simulated_gpus": 4},
                      engines={"preflight_python": str(vllm_venv / "bin" / "python")})
        c.wait_states({"a1": "ready"})
        plain = ready_after("plain", "")
        probed = ready_after("tp", "preflight: required\n")
        folder = tmp_path / "agents" / "a1" / "work" / "engines"
        assert not (folder / "plain-0" / "preflight.json").exists()
        result = json.loads((folder / "tp-0" / "preflight.json").read_text())
        assert result["ok"] and result["backend"] == "gloo" and result["world"] == 2, result
        assert [r["bytes"] for r in result["results"]] == [64 << 10, 1 << 20, 4 << 20]
        assert all(r["busbw_gbps"] > 0 for r in result["results"])
        log = (folder / "tp-0" / "engine.log").read_text()
        passed = log.index("llmgw launcher: pre-flight passed: gloo x2")
        assert log.index("llmgw launcher: exec engine") > passed, log
        r = c.ctl("describe", "replica", "tp-0", "-o", "json")
        d = json.loads(r.stdout)
        assert any(e["text"] == "pre-flight: the probe runs on a1" for e in d["events"]), d["events"]
        assert list(d["preflight"]) == ["a1"] and d["preflight"]["a1"].startswith(
            "passed: gloo x2, 4 MiB at "), d["preflight"]
        print(f"\npre-flight single-node TP=2: ready {probed:.1f}s after apply (without it "
              f"{plain:.1f}s); probe {result['seconds']:.1f}s; {result['line']}")
    finally:
        c.close()

"""The pre-flight for real on CPU (issue 22): a server and two agents on loopback, one
fabric, a two-node replica. Before either member's engine starts, each agent runs llmgw's
probe with the vLLM CPU environment's Python (torch) and the engine's own environment:
torch.distributed over Gloo on 127.0.0.1 at the head's rendezvous port, an all-reduce
checked for correctness and timed. The replica is `preflight` while it runs; the engines
start only after it passed; each member's figures are in its engine log, its folder's
preflight.json and `describe replica`.

The engine is the simulated one (vLLM's CPU build across two "nodes" on two cores would
take minutes and prove nothing more about the probe); `engines.preflight_python` names
the vLLM environment's Python for the probe, as a node whose engine lacks torch would.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from fakes.live import Cluster, wait_for
from fakes.sysfs import hca_nodes

pytestmark = pytest.mark.real_engine


class Rig:
    def __init__(self, c: Cluster, venv: Path) -> None:
        self.c = c
        self.kw = hca_nodes(c.root, ("a1", "a2"), ("mlx5_0",),
                            engines={"preflight_python": str(venv / "bin" / "python")})

    def replicas(self) -> dict[str, dict[str, Any]]:
        return self.c.replicas()

    def apply(self, name: str, body: str) -> None:
        self.c.apply(name, f"name: {name}\n{body}")


@pytest.fixture
def rig(cluster: Cluster, vllm_venv: Path) -> Rig:
    return Rig(cluster, vllm_venv)


def test_two_nodes_pass_the_gloo_preflight_before_their_engines_start(rig: Rig, tmp_path: Path) -> None:
    c = rig.c
    c.up(rig.kw)
    t0 = time.monotonic()
    rig.apply("gang", "model: org/gang\nengine: simulated\ngpus_per_node: 1\nnodes: 2\n"
              "replicas: 1\npreflight: required\n")
    wait_for(lambda: rig.replicas().get("gang-0", {}).get("state") == "ready", 90, "gang-0 ready")
    took = time.monotonic() - t0
    rep = rig.replicas()["gang-0"]
    assert sorted(rep["nodes"]) == ["a1", "a2"] and rep["fabric"] == "ib-a"
    for name in ("a1", "a2"):
        folder = tmp_path / "agents" / name / "work" / "engines" / "gang-0"
        result = json.loads((folder / "preflight.json").read_text())
        assert result["ok"] and result["backend"] == "gloo" and result["world"] == 2, result
        assert [r["bytes"] for r in result["results"]] == [64 << 10, 1 << 20, 4 << 20]
        assert all(r["busbw_gbps"] > 0 for r in result["results"])
        log = (folder / "engine.log").read_text()
        # The probe's verdict comes before the engine's first line: it ran first.
        passed = log.index("llmgw launcher: pre-flight passed: gloo x2")
        assert log.index("llmgw launcher: exec engine") > passed, log
    # The replica waited in its pre-flight state, and describe shows each member's figures.
    r = c.ctl("describe", "replica", "gang-0", "-o", "json")
    d = json.loads(r.stdout)
    assert any(e["text"] == "pre-flight: the probe runs on " + ", ".join(d["nodes"])
               for e in d["events"]), d["events"]
    assert sorted(d["preflight"]) == ["a1", "a2"], d["preflight"]
    assert all(x.startswith("passed: gloo x2, 4 MiB at ") for x in d["preflight"].values()), d
    print(f"\npre-flight two-node replica: ready {took:.1f}s after apply; "
          f"probe {result['seconds']:.1f}s; {result['line']}")

"""The pre-flight of a single-node tensor-parallel replica (issue 22), live: a server and
agents on loopback, two simulated GPUs each, a deployment of one node and two GPUs with
`preflight: required`, and a probe double named in agent.yaml (engines.preflight_probe,
for tests only) that records what it was given. The replica is `preflight` while the
probe runs on its one node (a world of its two GPUs on 127.0.0.1, the engine's own
CUDA_VISIBLE_DEVICES), then starts; describe replica shows the figures. A probe that
reports low bandwidth keeps the engine from starting; the node is avoided and the
replica starts on another."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from fakes.live import Cluster, wait_for

pytestmark = pytest.mark.slow

PASSED = "passed: nccl x2, 256 MiB at 40 GB/s bus bandwidth, in 2.0s"
PROBE = """import json, os, sys, time
cfg = json.loads(os.environ["LLMGW_PREFLIGHT"])
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(os.getcwd(), "probe_saw.json"), "w") as f:
    json.dump({"cfg": cfg, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}, f)
time.sleep(2.0)
bw = float(open(os.path.join(here, "busbw")).read())
print("LLMGW_PREFLIGHT " + json.dumps({"ok": True, "backend": "nccl", "world": cfg["local_ranks"],
      "seconds": 2.0, "results": [{"bytes": 268435456, "seconds": 0.01, "algbw_gbps": bw,
      "busbw_gbps": bw}]}))
"""


def apply(c: Cluster, root: Path) -> None:
    f = root / "tp.yaml"
    f.write_text("name: tp\nmodel: org/tp\nengine: simulated\ngpus_per_node: 2\nreplicas: 1\n"
                 "preflight: required\npreflight_min_busbw: 10\n")
    r = c.ctl("apply", "-f", str(f))
    assert r.returncode == 0, r.stderr


def test_a_single_node_tp_replica_waits_in_preflight_then_shows_its_figures(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    (tmp_path / "busbw").write_text("40")

    def describe() -> dict[str, Any]:
        r = c.ctl("describe", "replica", "tp-0", "-o", "json")
        return json.loads(r.stdout) if r.returncode == 0 else {}

    try:
        c.start_server()
        c.start_agent("a1", discovery={"simulated_gpus": 2},
                      engines={"preflight_python": sys.executable, "preflight_probe": str(probe)})
        c.wait_states({"a1": "ready"})
        apply(c, tmp_path)
        d = wait_for(lambda: (x := describe()).get("state") == "preflight" and x, 20, "tp-0 in preflight")
        assert set(d["preflight"].values()) <= {"running", PASSED}, d["preflight"]
        assert any(e["text"] == "pre-flight: the probe runs on a1" for e in d["events"]), d["events"]
        wait_for(lambda: describe().get("state") == "ready", 30, "tp-0 ready")
        d = describe()
        assert d["preflight"] == {"a1": PASSED}, d["preflight"]
        assert f"Pre-flight:\n  a1: {PASSED}" in c.ctl("describe", "replica", "tp-0").stdout
        node = c.ctl("describe", "node", "a1")
        assert "pre-flight on its GPUs: 40 GB/s bus bandwidth (tp-0, one node)" in node.stdout, node.stdout
        folder = tmp_path / "agents" / "a1" / "work" / "engines" / "tp-0"
        saw = json.loads((folder / "probe_saw.json").read_text())
        cfg = saw["cfg"]
        port = int(d["endpoint"].rsplit(":", 1)[1])  # the simulated engine's own (no block)
        assert (cfg["nnodes"], cfg["node_rank"], cfg["local_ranks"]) == (1, 0, 2), cfg
        assert (cfg["master_addr"], cfg["master_port"]) == ("127.0.0.1", port), cfg
        assert saw["cuda"] is not None and len(saw["cuda"].split(",")) == 2, saw
        log = (folder / "engine.log").read_text()
        assert log.index("llmgw launcher: exec engine") > log.index(f"llmgw launcher: pre-flight {PASSED}")
    finally:
        c.close()


def test_a_failed_single_node_probe_avoids_the_node_and_starts_elsewhere(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    (tmp_path / "busbw").write_text("0.4")
    kw = {"discovery": {"simulated_gpus": 2},
          "engines": {"preflight_python": sys.executable, "preflight_probe": str(probe)}}

    def describe() -> dict[str, Any]:
        r = c.ctl("describe", "replica", "tp-0", "-o", "json")
        return json.loads(r.stdout) if r.returncode == 0 else {}

    try:
        c.start_server()
        c.start_agent("a1", **kw)
        c.wait_states({"a1": "ready"})
        apply(c, tmp_path)
        why = "bus bandwidth 0.4 GB/s is below 10 GB/s"
        want = (f"pre-flight failed on a1 (its GPUs' links on one node): {why}; "
                "avoiding them for 600s, placing again")
        wait_for(lambda: any(e["text"] == want for e in describe().get("events", [])), 30,
                 "the pre-flight failure event")
        d = describe()
        assert d["state"] == "pending" and d["nodes"] == [], d
        assert f"llmgw launcher: pre-flight failed: {why}" in d["last_log_tail"]
        log = (tmp_path / "agents" / "a1" / "work" / "engines" / "tp-0" / "engine.log").read_text()
        assert "exec engine" not in log, log
        # Another node whose probe passes: the replica goes there and starts.
        (tmp_path / "busbw").write_text("40")
        c.start_agent("a2", **kw)
        wait_for(lambda: describe().get("state") == "ready", 30, "tp-0 ready on a2")
        d = describe()
        assert d["nodes"] == ["a2"] and d["preflight"] == {"a2": PASSED}, d
    finally:
        c.close()

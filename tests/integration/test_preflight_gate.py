"""The pre-flight as a gate (issue 22): a server and agents on loopback, simulated GPUs
and engines, and a probe double named in agent.yaml (engines.preflight_probe, for tests
only) that reports low bandwidth on node a1, or hangs on a2. The two-node replica placed
on a1+a2 does not start; the event names the nodes and the reason (the bandwidth, or the
timeout), and both are avoided: with a3 and a4 joining, it is placed there and starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from fakes.live import Cluster, wait_for
from fakes.sysfs import hca_nodes

pytestmark = [pytest.mark.slow, pytest.mark.live_long]  # waits out real windows: .ci/run -m live_long

PROBE = """import json, os, time
parts = os.getcwd().split(os.sep)  # <root>/agents/<node>/work/engines/<replica>
node = parts[parts.index("agents") + 1]
mode = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "mode")).read().strip()
if mode == "hang" and node == "a2":
    time.sleep(600)  # a collective that hangs: the launcher's bound ends it
bw = 0.4 if mode == "slow" and node == "a1" else 50.0
print("LLMGW_PREFLIGHT " + json.dumps({"ok": True, "backend": "nccl", "world": 2, "seconds": 0.1,
      "results": [{"bytes": 268435456, "seconds": 0.01, "algbw_gbps": bw, "busbw_gbps": bw}]}))
"""


class Rig:
    def __init__(self, c: Cluster) -> None:
        self.root = c.root
        self.c = c
        probe = c.root / "probe.py"
        probe.write_text(PROBE)
        self.kw = hca_nodes(c.root, ("a1", "a2", "a3", "a4"), ("mlx5_0",), engines={
            "preflight_python": sys.executable, "preflight_probe": str(probe)})

    def start(self, *names: str) -> None:
        for name in names:
            self.c.start_agent(name, **self.kw[name])
        self.c.wait_states(dict.fromkeys(names, "ready"))

    def replica(self) -> dict[str, Any]:
        r = self.c.ctl("describe", "replica", "gang-0", "-o", "json")
        return json.loads(r.stdout) if r.returncode == 0 else {}


@pytest.fixture
def rig(cluster: Cluster) -> Rig:
    return Rig(cluster)



@pytest.mark.parametrize("mode, node, why", [
    ("slow", "a1", "bus bandwidth 0.4 GB/s is below 10 GB/s"),
    ("hang", "a2", "timed out after 2s (a peer that never came, or a collective that hangs)"),
])
def test_a_slow_or_hung_preflight_keeps_the_gang_off_those_nodes(
        rig: Rig, tmp_path: Path, mode: str, node: str, why: str) -> None:
    c = rig.c
    (tmp_path / "mode").write_text(mode)
    c.start_server()
    rig.start("a1", "a2")
    f = tmp_path / "gang.yaml"
    f.write_text("name: gang\nmodel: org/gang\nengine: simulated\ngpus_per_node: 1\nnodes: 2\n"
                 "replicas: 1\npreflight: required\npreflight_timeout: 2s\npreflight_min_busbw: 10\n")
    assert c.ctl("apply", "-f", str(f)).returncode == 0
    want = f"pre-flight failed on a1, a2 (fabric ib-a): {why}; avoiding them for 600s, placing again"

    def failed() -> bool:
        return any(e["text"] == want for e in rig.replica().get("events", []))

    wait_for(failed, 60, "the pre-flight failure event")
    d = rig.replica()
    assert d["state"] == "pending" and d["nodes"] == [], d
    assert f"llmgw launcher: pre-flight failed: {why}" in d["last_log_tail"]
    log = (tmp_path / "agents" / node / "work" / "engines" / "gang-0" / "engine.log").read_text()
    assert f"llmgw launcher: pre-flight failed: {why}" in log and "exec engine" not in log, log
    # Two more nodes: the gang goes there, passes and starts.
    rig.start("a3", "a4")
    wait_for(lambda: rig.replica().get("state") == "ready", 60, "gang-0 ready on a3+a4")
    assert sorted(rig.replica()["nodes"]) == ["a3", "a4"]

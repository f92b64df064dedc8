"""The pre-flight as a step of the replica's life (issue 22), live: a server and two
agents on loopback, simulated GPUs and engines, and a probe double named in agent.yaml
(engines.preflight_probe, for tests only) that takes 3 s, then passes at 50 GB/s. The
two-node replica is `preflight` while it runs, then starts and is ready; describe replica
shows each member's figures, describe node and ctl status the fabric's last figures, and the
server's metrics llmgw_server_preflight_busbw_gbps{fabric}."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fakes.browser import Browser, available
from fakes.engines import free_port
from fakes.live import Cluster, wait_for
from fakes.sysfs import add_hca

pytestmark = pytest.mark.slow

TOKEN = "test-token-0123456789abcdef"
PASSED = "passed: nccl x2, 256 MiB at 50 GB/s bus bandwidth, in 3.0s"
PROBE = """import json, time
time.sleep(3.0)
print("LLMGW_PREFLIGHT " + json.dumps({"ok": True, "backend": "nccl", "world": 2, "seconds": 3.0,
      "results": [{"bytes": 268435456, "seconds": 0.01, "algbw_gbps": 50.0, "busbw_gbps": 50.0}]}))
"""


def busbw(port: int) -> dict[str, float]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        text = r.read().decode()
    return {s.labels["fabric"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "llmgw_server_preflight_busbw_gbps"}


def test_the_replica_waits_in_preflight_then_shows_its_figures(tmp_path: Path) -> None:
    metrics = free_port()
    c = Cluster(tmp_path, extra_server=f'metrics_bind = "127.0.0.1:{metrics}"\n'
                                       f'metrics_token = "{TOKEN}"\n')
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)

    def describe(kind: str, name: str) -> dict[str, Any]:
        r = c.ctl("describe", kind, name, "-o", "json")
        return json.loads(r.stdout) if r.returncode == 0 else {}

    try:
        c.start_server()
        for name in ("a1", "a2"):
            ib = tmp_path / "ib" / name
            add_hca(ib, "mlx5_0")
            c.start_agent(name, discovery={"ib_root": str(ib), "simulated_gpus": 2},
                          fabrics=[{"name": "ib-a", "hcas": ["mlx5_0"]}],
                          engines={"preflight_python": sys.executable, "preflight_probe": str(probe)})
        c.wait_states({"a1": "ready", "a2": "ready"})
        f = tmp_path / "gang.yaml"
        f.write_text("name: gang\nmodel: org/gang\nengine: simulated\ngpus_per_node: 1\nnodes: 2\n"
                     "replicas: 1\npreflight: required\npreflight_timeout: 20s\npreflight_min_busbw: 10\n")
        assert c.ctl("apply", "-f", str(f)).returncode == 0
        d = wait_for(lambda: (x := describe("replica", "gang-0")).get("state") == "preflight" and x,
                     20, "gang-0 in preflight")
        assert set(d["preflight"].values()) <= {"running", PASSED}, d["preflight"]
        assert any(e["text"] == "pre-flight: the probe runs on " + ", ".join(d["nodes"])
                   for e in d["events"]), d["events"]
        assert c.ctl("describe", "replica", "gang-0").stdout.count("Pre-flight:") == 1
        wait_for(lambda: describe("replica", "gang-0").get("state") == "ready", 30, "gang-0 ready")
        d = describe("replica", "gang-0")
        assert d["preflight"] == {"a1": PASSED, "a2": PASSED}, d["preflight"]
        n = describe("node", "a1")
        assert n["preflight"]["ib-a"]["busbw_gbps"] == 50.0 and n["preflight"]["ib-a"]["replica"] == "gang-0"
        assert ("pre-flight on ib-a: 50 GB/s bus bandwidth (slowest member of gang-0, a1, a2)"
                in c.ctl("describe", "node", "a1").stdout)
        assert busbw(metrics) == {"ib-a": 50.0}
        st = c.status()  # ctl status -o json: the status document
        assert st["preflight"]["ib-a"]["busbw_gbps"] == 50.0, st.get("preflight")
        assert "pre-flight on ib-a: 50 GB/s" in c.ctl("status").stdout
        if available():  # the status page's fabrics table (headless Chromium)
            b = Browser(tmp_path / "chromedriver.log")
            try:
                b.get(f"http://127.0.0.1:{metrics}/?token={TOKEN}")
                cell = "return (document.querySelector('tr[data-fabric=\"ib-a\"] [data-field=preflight]')" \
                       " || {}).textContent || ''"
                wait_for(lambda: b.js(cell) == "50.0 GB/s (gang-0: a1, a2)", 20,
                         "the fabric's pre-flight on the status page")
            finally:
                b.close()
    finally:
        c.close()

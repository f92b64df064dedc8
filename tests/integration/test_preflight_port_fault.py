"""A pre-flight whose rendezvous port was taken (issue 30 item 4), live: a server and one
agent on loopback, two simulated GPUs, a deployment of one node and two GPUs with
`preflight: required`, and a probe double that fails the first time as torch's TCPStore
does on a port another process holds (EADDRINUSE). That is the port's fault: the replica
is placed again at once on the same node — no node avoided, though it is the only one —
on another port, and starts. Before, the node was avoided for 600 s and the replica
waited, pending, with nowhere to go."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from fakes.live import Cluster, wait_for

pytestmark = pytest.mark.slow

PROBE = """import json, os
cfg = json.loads(os.environ["LLMGW_PREFLIGHT"])
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "ports"), "a") as f:
    f.write(f"{cfg['master_port']}\\n")
flag = os.path.join(here, "taken_once")
if not os.path.exists(flag):
    open(flag, "w").close()
    print("LLMGW_PREFLIGHT " + json.dumps({"ok": False, "backend": "gloo", "rank": 0, "error":
          "DistNetworkError: The server socket has failed to listen on any local network address. "
          f"port: {cfg['master_port']}, useIpv6: false, code: -98, name: EADDRINUSE, "
          "message: address already in use"}))
    raise SystemExit(1)
print("LLMGW_PREFLIGHT " + json.dumps({"ok": True, "backend": "gloo", "world": 2, "seconds": 0.1,
      "results": [{"bytes": 4194304, "seconds": 0.01, "algbw_gbps": 1.0, "busbw_gbps": 1.0}]}))
"""


def test_a_taken_rendezvous_port_moves_the_replica_to_another_port_not_off_the_node(
        tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)

    def describe() -> dict[str, Any]:
        r = c.ctl("describe", "replica", "tp-0", "-o", "json")
        return json.loads(r.stdout) if r.returncode == 0 else {}

    try:
        c.start_server()
        c.start_agent("a1", discovery={"simulated_gpus": 2},
                      engines={"preflight_python": sys.executable, "preflight_probe": str(probe)})
        c.wait_states({"a1": "ready"})
        f = tmp_path / "tp.yaml"
        f.write_text("name: tp\nmodel: org/tp\nengine: simulated\ngpus_per_node: 2\nreplicas: 1\n"
                     "preflight: required\n")
        r = c.ctl("apply", "-f", str(f))
        assert r.returncode == 0, r.stderr
        wait_for(lambda: describe().get("state") == "ready", 30, "tp-0 ready on a1 again")
        d = describe()
        assert d["nodes"] == ["a1"] and d["restarts"] == 0, d
        first, second = (int(p) for p in (tmp_path / "ports").read_text().split())
        assert first != second  # the taken port is not given again on this node
        texts = [e["text"] for e in d["events"]]
        assert any(t.startswith(f"port {first} on a1 is taken (rendezvous port {first} is in use (")
                   and t.endswith("placing again on another port, avoiding no node") for t in texts), texts
        assert not any("avoiding them for" in t for t in texts), texts
    finally:
        c.close()

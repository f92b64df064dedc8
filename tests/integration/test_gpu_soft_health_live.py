"""GPU health on real processes (issue 30 item 3): a server and an agent whose pynvml is
tests/fakes/nvml_file (two GPUs, read from a state file), simulated engines.

A pending row remap appears on the GPU a replica serves on: the replica stays (same
generation, no replacement), the GPU is "degraded" with its reason, and a new deployment
goes to the other GPU. Then an Xid 48 on that other GPU (hard): its replica would move,
but has nowhere to go and serves on; `ctl gpu clear` forgets the Xid and the GPU is
healthy again. The same Xid once more, NVML asking for a reset and then no longer: the
agent sees the reset and forgets the Xid by itself."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from fakes.live import LLMGW, Cluster, Proc, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.live_long]  # waits out GPU health windows: .ci/run -m live_long

FAKE = Path(__file__).resolve().parents[1] / "fakes" / "nvml_file"
NODE = "g1"


def body(name: str) -> str:
    return (f"name: {name}\nmodel: org/{name}\nengine: simulated\ngpus_per_node: 1\n"
            "replicas: 1\ndrain_timeout: 0s\n")


class Rig:
    def __init__(self, c: Cluster) -> None:
        self.c = c
        self.state = c.root / "nvml.json"
        self.doc: dict[str, Any] = {"gpus": 2, "remap_pending": [], "xids": []}
        self.write()

    def write(self) -> None:
        tmp = self.state.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc))
        os.replace(tmp, self.state)

    def up(self) -> None:
        self.c.start_server()
        cfg = self.c.agent_config(NODE, discovery={"prefer_nvml": True, "nvidia_smi": "", "interval": "1s"})
        env = {"PYTHONPATH": os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")]),
               "LLMGW_TEST_NVML": str(self.state)}
        self.c.procs.append(Proc([*LLMGW, "agent", "--config", str(cfg)], cfg.parent / "agent.log", env=env))
        self.c.wait_states({NODE: "ready"}, timeout=20)

    def gpus(self) -> dict[str, dict[str, Any]]:
        return {g["uuid"]: g for g in self.c.ok_json("describe", "node", NODE)["gpus"]}

    def ready(self, rid: str) -> dict[str, Any]:
        wait_for(lambda: self.c.replicas().get(rid, {}).get("state") == "ready", 40, f"{rid} ready")
        return self.c.replicas()[rid]


@pytest.fixture
def rig(cluster: Cluster) -> Rig:
    return Rig(cluster)


def test_a_pending_remap_keeps_the_replica_and_new_work_goes_elsewhere(rig: Rig) -> None:
    c = rig.c
    rig.up()
    gpus = rig.gpus()
    assert len(gpus) == 2 and all(g["state"] == "healthy" for g in gpus.values()), gpus
    c.apply("a", body("a"))
    a0 = rig.ready("a-0")
    (held,) = a0["gpus"]
    index = gpus[held]["index"]

    rig.doc["remap_pending"] = [index]
    rig.write()
    wait_for(lambda: rig.gpus()[held]["state"] == "degraded", 15, "the GPU degraded")
    g = rig.gpus()[held]
    assert g["problems"] == [] and g["soft_problems"] == ["row remap pending (reset the GPU when it is idle)"]
    text = c.ok("describe", "node", NODE)
    assert f"GPU {index} takes no new work: row remap pending" in text

    # Several discoveries later the replica still serves where it was: no replacement.
    time.sleep(4)
    reps = c.replicas()
    assert set(reps) == {"a-0"}, reps
    assert reps["a-0"]["state"] == "ready" and reps["a-0"]["generation"] == a0["generation"]

    # A new deployment avoids the GPU with the pending remap.
    c.apply("b", body("b"))
    b0 = rig.ready("b-0")
    assert b0["gpus"] != [held]

    # An Xid 48 on b's GPU is hard: b-0 must move, has nowhere to go, and serves on.
    (other,) = b0["gpus"]
    rig.doc["xids"] = [[rig.gpus()[other]["index"], 48]]
    rig.write()
    wait_for(lambda: rig.gpus()[other]["state"] == "unhealthy", 15, "Xid 48 seen")
    assert rig.gpus()[other]["problems"][0].startswith("Xid 48 at ")
    wait_for(lambda: "b-1" in c.replicas(), 15, "b-1, b-0's replacement, asked for")
    reps = c.replicas()
    assert reps["b-0"]["state"] == "ready" and reps["b-1"]["state"] == "pending"
    assert "taking no new work" in reps["b-1"]["reason"], reps["b-1"]["reason"]

    # The operator clears the Xid: the GPU is healthy again and b-0 stays.
    r = c.ctl("gpu", "clear", NODE, str(rig.gpus()[other]["index"]))
    assert r.returncode == 0, r.stderr
    assert "cleared 1 Xid problem" in r.stdout, r.stdout
    wait_for(lambda: rig.gpus()[other]["state"] == "healthy", 15, "the Xid cleared")
    wait_for(lambda: set(c.replicas()) == {"a-0", "b-0"}, 15, "b-1 dropped")
    assert c.replicas()["b-0"]["generation"] == b0["generation"]

    # The same Xid again, then NVML asks for a reset and later no longer does: the agent
    # takes that as the reset and drops the Xid by itself.
    rig.doc["xids"].append([rig.gpus()[other]["index"], 48])
    rig.write()
    wait_for(lambda: rig.gpus()[other]["state"] == "unhealthy", 15, "Xid 48 seen again")
    rig.doc["recovery"] = {str(rig.gpus()[other]["index"]): 1}
    rig.write()
    wait_for(lambda: any("recovery action 1" in p for p in rig.gpus()[other]["problems"]), 15,
             "the recovery action seen")
    rig.doc["recovery"] = {}
    rig.write()
    wait_for(lambda: rig.gpus()[other]["state"] == "healthy", 15, "the Xid cleared by the reset")
    wait_for(lambda: set(c.replicas()) == {"a-0", "b-0"}, 15, "b-1 dropped again")

    bad = c.ctl("gpu", "clear", NODE, "7")
    assert bad.returncode == 1 and "has no GPU '7'" in bad.stderr, bad.stderr

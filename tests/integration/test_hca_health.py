"""An HCA port going DOWN under a running two-node replica (issue 22): a server and two
agents on loopback (fake sysfs HCAs, simulated GPUs and engines). The agent's HCA watch
sees the port leave ACTIVE, the server places a replacement on the healthy HCAs first and
stops the old replica once it is ready; the port ACTIVE again, the HCA counts again."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from fakes.live import Cluster, wait_for
from fakes.sysfs import PHYS, STATES, hca_nodes

pytestmark = pytest.mark.slow


GANG = ("name: gang\nmodel: org/gang\nengine: simulated\ngpus_per_node: 1\nnodes: 2\n"
        "replicas: 1\ndrain_timeout: 0s\n")


class Rig:
    def __init__(self, c: Cluster) -> None:
        self.c = c
        self.root = c.root
        self.kw = hca_nodes(c.root, ("a1", "a2"), ("mlx5_0", "mlx5_1"),
                            discovery={"hca_interval": "500ms", "hca_quiet": "1s"})

    def set_port(self, node: str, hca: str, state: str) -> None:
        port = self.root / "ib" / node / hca / "ports" / "1"
        (port / "state").write_text(STATES[state] + "\n")
        (port / "phys_state").write_text(PHYS[state] + "\n")

    def ctl_json(self, *args: str) -> Any:
        return self.c.ok_json(*args)

    def replicas(self) -> dict[str, dict[str, Any]]:
        return self.c.replicas()

    def gang_ready(self) -> Path:
        """Both nodes up and gang-0, one replica across them, ready. Returns its file."""
        self.c.up(self.kw)
        f = self.c.apply("gang", GANG)
        wait_for(lambda: self.replicas().get("gang-0", {}).get("state") == "ready", 40, "gang-0 ready")
        return f


@pytest.fixture
def rig(cluster: Cluster) -> Rig:
    return Rig(cluster)


def test_an_hca_going_down_moves_its_replica_onto_healthy_hcas(rig: Rig) -> None:
    c = rig.c
    f = rig.gang_ready()
    nics = rig.ctl_json("describe", "replica", "gang-0")["nics"]
    assert all("mlx5_0" in " ".join(v) for v in nics.values()), nics

    rig.set_port("a2", "mlx5_0", "DOWN")
    t0 = time.monotonic()

    def moved() -> bool:
        reps = rig.replicas()
        return "gang-0" not in reps and reps.get("gang-1", {}).get("state") == "ready"

    wait_for(moved, 30, "gang-1 ready in place of gang-0")
    took = time.monotonic() - t0
    d = rig.ctl_json("describe", "replica", "gang-1")
    # On a2 it rides mlx5_1 only; a1's HCAs are all healthy.
    assert d["nics"]["a2"] == ["GPU 1 -> mlx5_1 (unknown)"], d["nics"]
    node = rig.ctl_json("describe", "node", "a2")
    bad = {h["name"]: h for h in node["hcas"]}["mlx5_0"]
    assert not bad["healthy"] and bad["problems"] == ["port 1 DOWN (Disabled)"]
    text = c.ctl("describe", "node", "a2").stdout
    assert "HCA mlx5_0 unhealthy, not counted in its fabric: port 1 DOWN (Disabled)" in text

    # ACTIVE again (and quiet for hca_quiet): the HCA counts again; nothing else moves.
    rig.set_port("a2", "mlx5_0", "ACTIVE")
    wait_for(lambda: {h["name"]: h["healthy"] for h in rig.ctl_json("describe", "node", "a2")["hcas"]}
             == {"mlx5_0": True, "mlx5_1": True}, 20, "mlx5_0 healthy again")
    time.sleep(2)
    assert sorted(rig.replicas()) == ["gang-1"]
    # Scaling up now may use mlx5_0 on a2 again.
    f.write_text(f.read_text().replace("replicas: 1", "replicas: 2"))
    assert c.ctl("apply", "-f", str(f)).returncode == 0
    other = wait_for(lambda: next((k for k, v in rig.replicas().items()
                                   if k != "gang-1" and v["state"] == "ready"), None), 40, "a second replica ready")
    assert "mlx5_0" in " ".join(rig.ctl_json("describe", "replica", other)["nics"]["a2"])
    print(f"\nHCA port DOWN -> replica moved (replacement ready, old stopped): {took:.1f}s")


def test_an_hca_gone_from_sysfs_moves_its_replica_and_counts_again_when_back(rig: Rig, tmp_path: Path) -> None:
    rig.gang_ready()
    # A firmware reset takes the device away: its sysfs folder is gone for a while.
    hca = tmp_path / "ib" / "a1" / "mlx5_0"
    hca.rename(tmp_path / "mlx5_0-away")
    wait_for(lambda: "gang-0" not in rig.replicas() and rig.replicas().get("gang-1", {}).get("state")
             == "ready", 30, "gang-1 ready in place of gang-0")
    assert rig.ctl_json("describe", "replica", "gang-1")["nics"]["a1"] == ["GPU 1 -> mlx5_1 (unknown)"]
    node = rig.ctl_json("describe", "node", "a1")
    assert {h["name"]: h["problems"] for h in node["hcas"]}["mlx5_0"] == ["not found in sysfs"]
    assert node["state"] == "ready"  # the agent runs on; only the HCA is out
    (tmp_path / "mlx5_0-away").rename(hca)
    wait_for(lambda: {h["name"]: h["healthy"] for h in rig.ctl_json("describe", "node", "a1")["hcas"]}
             == {"mlx5_0": True, "mlx5_1": True}, 20, "mlx5_0 back and healthy")

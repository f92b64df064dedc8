"""The control plane end to end: a server and three agents as real processes (GPUs from
fake nvidia-smi, fabrics from fake sysfs), simulated engines, real CURVE and SQLite."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from fakes.live import Cluster, Proc, engine_pids, wait_for
from fakes.nvidia_smi import pcie_box
from fakes.sysfs import add_hca

pytestmark = [pytest.mark.slow, pytest.mark.live_long]  # waits out loss and restart windows: .ci/run -m live_long


def _answers(url: str) -> bool:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=1)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


class Rig:
    def __init__(self, c: Cluster) -> None:
        self.c = c
        root = c.root
        smi = pcie_box(root / "smi")
        self.agent_kw: dict[str, dict[str, Any]] = {}
        for name, fabric in (("a1", "ib-a"), ("a2", "ib-a"), ("a3", None)):
            ib = root / "ib" / name
            ib.mkdir(parents=True)
            kw: dict[str, Any] = {"discovery": {"nvidia_smi": str(smi), "ib_root": str(ib)}}
            if fabric:
                add_hca(ib, "mlx5_0")
                kw["fabrics"] = [{"name": fabric, "hcas": ["mlx5_0"]}]
            self.agent_kw[name] = kw
        self.agents: dict[str, Proc] = {}

    def start_agent(self, name: str) -> None:
        self.agents[name] = self.c.start_agent(name, **self.agent_kw[name])

    def replicas(self) -> dict[str, dict[str, Any]]:
        return self.c.replicas()

    def ready(self) -> dict[str, dict[str, Any]]:
        return {k: v for k, v in self.replicas().items() if v["state"] == "ready"}

    def apply(self, name: str, body: str) -> None:
        self.c.apply(name, f"name: {name}\n{body}")


@pytest.fixture
def rig(make_cluster: Callable[..., Cluster]) -> Rig:
    return Rig(make_cluster(heartbeat="1s", lost_after="4s", extra_server='restart_grace = "4s"\n'))


def test_place_lose_return_restart_drain(rig: Rig, tmp_path: Path) -> None:
    c = rig.c
    server = c.start_server()
    for name in ("a1", "a2", "a3"):
        rig.start_agent(name)
    c.wait_states({"a1": "ready", "a2": "ready", "a3": "ready"})

    rig.apply("single", "model: org/single\nengine: simulated\ngpus_per_node: 1\n"
              "replicas: 2\nstrategy: spread\n")
    rig.apply("gang", "model: org/gang\nengine: simulated\ngpus_per_node: 1\n"
              "nodes: 2\nreplicas: 1\n")
    wait_for(lambda: len(rig.ready()) == 3, 40, "three replicas ready")
    reps = rig.replicas()
    # The two-node replica lives inside the fabric; the island never holds it.
    assert sorted(reps["gang-0"]["nodes"]) == ["a1", "a2"]
    assert reps["gang-0"]["fabric"] == "ib-a"
    st = c.status()
    assert {d["name"]: d["status"] for d in st["deployments"]} == {"gang": "ready", "single": "ready"}

    # --- SIGKILL the agent of a node holding a single-node replica and keep it down.
    victim_rep = next(r for r in ("single-0", "single-1") if reps[r]["nodes"] != ["a1"])
    victim = reps[victim_rep]["nodes"][0]
    stale_url = reps[victim_rep]["endpoint"]
    stale_gen = reps[victim_rep]["generation"]
    rig.agents[victim].stop(signal.SIGKILL)
    c.wait_states({victim: "lost"}, timeout=20)
    wait_for(lambda: (r := rig.ready().get(victim_rep)) and victim not in r["nodes"]
             and r["generation"] > stale_gen, 30, f"{victim_rep} placed elsewhere")
    # The engine outlived its agent and still answers, fenced off by its old generation.
    assert _answers(stale_url)

    # --- Bring it back: its stale engine is stopped.
    rig.start_agent(victim)
    c.wait_states({victim: "ready"})
    wait_for(lambda: not _answers(stale_url), 20, "the stale engine stopped")
    assert victim_rep in rig.ready()

    # --- SIGKILL the server and start it again: no engine restarts.
    wait_for(lambda: len(rig.ready()) == 3, 30, "all ready before the server restart")
    before = engine_pids(tmp_path)
    gens = {k: v["generation"] for k, v in rig.replicas().items()}
    server.stop(signal.SIGKILL)
    c.procs.remove(server)
    server = c.start_server()
    c.wait_states({"a1": "ready", "a2": "ready", "a3": "ready"}, timeout=20)
    reconnected = time.monotonic()
    wait_for(lambda: len(rig.ready()) == 3, 10, "all ready after the server restart")
    # Within about one heartbeat of reconnecting (1 s here), with room for a busy machine.
    assert time.monotonic() - reconnected < 4.0
    assert engine_pids(tmp_path) == before
    assert {k: v["generation"] for k, v in rig.replicas().items()} == gens

    # --- Drain a node: the ready count never drops below the desired count.
    drained = next(r for r in ("single-0", "single-1") if rig.replicas()[r]["nodes"] != ["a3"])
    node = rig.replicas()[drained]["nodes"][0]
    lowest = [3]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            lowest[0] = min(lowest[0], len(rig.ready()))
            time.sleep(0.1)

    t = threading.Thread(target=watch)
    t.start()
    try:
        r = c.ctl("drain", node)
        assert r.returncode == 0, r.stderr
        wait_for(lambda: all(node not in v["nodes"] for k, v in rig.ready().items()
                             if k.startswith("single")) and len(rig.ready()) == 3,
                 40, f"single replicas moved off {node}")
    finally:
        stop.set()
        t.join()
    assert lowest[0] >= 3
    # The drain shows, in the table as kubectl writes it and as booleans in JSON.
    row = next(n for n in json.loads(c.ctl("get", "nodes", "-o", "json").stdout) if n["id"] == node)
    assert row["cordoned"] is True and row["draining"] is True
    assert f"{node} " in c.ctl("status").stdout
    assert "ready,SchedulingDisabled,Draining" in c.ctl("status").stdout
    assert c.ctl("uncordon", node).returncode == 0
    row = next(n for n in json.loads(c.ctl("get", "nodes", "-o", "json").stdout) if n["id"] == node)
    assert row["cordoned"] is False and row["draining"] is False

    # --- Deleting the deployments stops every engine.
    for name in ("single", "gang"):
        assert c.ctl("delete", "deployment", name).returncode == 0
    wait_for(lambda: not engine_pids(tmp_path), 30, "every engine stopped")

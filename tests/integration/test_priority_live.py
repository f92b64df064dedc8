"""Priorities when GPUs run out (issue 25), end to end: a server and an agent with two
simulated GPUs, real processes on loopback. A low-priority autoscaled deployment holds
both GPUs; a higher-priority one that cannot place its replica takes one (the low one
steps down, its replica drains, then the high one's is placed and ready); a second high
one finds the low one at its min and stays pending. Both deployments' events say so.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fakes.live import Cluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.live_long]  # waits out real windows: .ci/run -m live_long

DEP = """name: {name}
model: org/{name}
engine: simulated
gpus_per_node: 1
replicas: {replicas}
priority: {priority}
drain_timeout: 10s
{extra}"""
AUTO = "autoscale: {min: 1, max: 2, in_flight_per_replica: 100}\n"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, extra_server='drain_grace = "500ms"\n')
    try:
        c.start_server()
        c.start_agent("n1", discovery={"simulated_gpus": 2})
        c.wait_states({"n1": "ready"})
        yield c
    finally:
        c.close()


def apply(c: Cluster, tmp: Path, name: str, replicas: int, priority: int, extra: str = "") -> None:
    f = tmp / f"{name}.yaml"
    f.write_text(DEP.format(name=name, replicas=replicas, priority=priority, extra=extra))
    r = c.ctl("apply", "-f", str(f))
    assert r.returncode == 0, r.stderr


def states(c: Cluster) -> dict[str, list[str]]:
    r = c.ctl("get", "replicas", "-o", "json")
    assert r.returncode == 0, r.stderr
    out: dict[str, list[str]] = {}
    for row in json.loads(r.stdout):
        out.setdefault(row["deployment"], []).append(row["state"])
    return out


def spec(c: Cluster, name: str) -> dict[str, Any]:
    return json.loads(c.ctl("describe", "deployment", name, "-o", "json").stdout)  # type: ignore[no-any-return]


def test_higher_priority_takes_gpus_never_below_min(cluster: Cluster, tmp_path: Path) -> None:
    c = cluster
    apply(c, tmp_path, "low", 2, 0, AUTO)
    wait_for(lambda: states(c).get("low") == ["ready", "ready"], 40, "low on both GPUs", interval=0.3)

    t0 = time.monotonic()
    apply(c, tmp_path, "high", 1, 10)
    wait_for(lambda: states(c).get("high") == ["ready"], 60, "high placed and ready", interval=0.3)
    took = time.monotonic() - t0
    assert states(c)["low"] == ["ready"]
    assert spec(c, "low")["replicas"] == 1
    low_events = c.ctl("describe", "deployment", "low").stdout
    high_events = c.ctl("describe", "deployment", "high").stdout
    assert "autoscale: preempted 2 -> 1: high (priority 10) cannot place a replica" in low_events
    assert "priority: takes 1 GPU from low (priority 0)" in high_events, high_events

    # Another one of high priority: low is at its min, so nothing more is taken.
    apply(c, tmp_path, "high2", 1, 10)
    wait_for(lambda: states(c).get("high2") == ["pending"], 20, "high2 pending", interval=0.3)
    time.sleep(6)  # more than two of the server's decision rounds (2.5 s without routers)
    assert states(c)["low"] == ["ready"] and states(c)["high2"] == ["pending"]
    assert spec(c, "low")["replicas"] == 1
    print(f"\nhigh priority ready {took:.1f}s after its apply, one low replica drained first")

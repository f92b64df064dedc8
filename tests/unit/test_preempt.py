"""Priorities when GPUs run out (issue 25): server/placement/preempt.py, pure, and the autoscaler's
memory of a take in flight."""

from __future__ import annotations

from typing import Any

import pytest
from attrs import evolve

from llmgw.config.deployment import parse_deployment
from llmgw.errors import DeploymentError
from llmgw.model.deployment import Deployment, Replica, ReplicaState
from llmgw.server.elastic.autoscaler import PREEMPT_RETRY, Autoscaler
from llmgw.server.placement.preempt import choose

NO_GPUS = "0/1 nodes fit: 1 lacked 1 free GPU"


def dep(name: str, priority: int, replicas: int, **extra: Any) -> Deployment:
    return parse_deployment({"name": name, "model": f"org/{name}", "engine": "simulated",
                             "gpus_per_node": 1, "replicas": replicas, "priority": priority,
                             **extra}, "t")


def auto(name: str, priority: int, replicas: int, lo: int, hi: int = 4) -> Deployment:
    return dep(name, priority, replicas,
               autoscale={"min": lo, "max": hi, "in_flight_per_replica": 2})


def reps(d: Deployment, *states: ReplicaState) -> dict[str, Replica]:
    return {f"{d.name}-{i}": Replica(f"{d.name}-{i}", d.name, i, d, state=s)
            for i, s in enumerate(states)}


R, P, DR = ReplicaState.READY, ReplicaState.PENDING, ReplicaState.DRAINING


def test_a_higher_priority_takes_one_step_from_the_lowest() -> None:
    high, mid, low = dep("high", 10, 1), auto("mid", 5, 2, 1), auto("low", 1, 2, 1)
    ds = {d.name: d for d in (high, mid, low)}
    rs = {**reps(high, P), **reps(mid, R, R), **reps(low, R, R)}
    p = choose(ds, rs, {"high-0": NO_GPUS})
    assert p is not None and (p.taker, p.victim, p.victim_before, p.victim_after) == ("high", "low", 2, 1)
    assert "preempted 2 -> 1: high (priority 10)" in p.victim_reason and NO_GPUS in p.victim_reason
    assert "takes 1 GPU from low (priority 1)" in p.taker_reason


@pytest.mark.parametrize("why, ds, rs, pending", [
    ("never below min",
     [dep("high", 10, 1), auto("low", 1, 1, 1)], {"high": [P], "low": [R]}, NO_GPUS),
    ("never from equal priority",
     [dep("high", 1, 1), auto("low", 1, 2, 1)], {"high": [P], "low": [R, R]}, NO_GPUS),
    ("never from a deployment without autoscale (no min)",
     [dep("high", 10, 1), dep("low", 1, 2)], {"high": [P], "low": [R, R]}, NO_GPUS),
    ("not for another reason than GPUs",
     [dep("high", 10, 1), auto("low", 1, 2, 1)], {"high": [P], "low": [R, R]},
     "0/1 nodes fit: 1 lacked labels zone=a"),
    ("not while a drain frees GPUs already",
     [dep("high", 10, 1), auto("low", 1, 2, 1)], {"high": [P], "low": [R, DR]}, NO_GPUS),
    ("not from a smaller shape",
     [dep("high", 10, 1, gpus_per_node=2), auto("low", 1, 2, 1)], {"high": [P], "low": [R, R]},
     NO_GPUS),
    ("not from one placed nowhere",
     [dep("high", 10, 1), auto("low", 1, 2, 1)], {"high": [P], "low": [P, P]}, NO_GPUS),
])
def test_what_is_never_taken(why: str, ds: list[Deployment], rs: dict[str, list[ReplicaState]],
                             pending: str) -> None:
    by = {d.name: d for d in ds}
    replicas = {k: v for name, states in rs.items() for k, v in reps(by[name], *states).items()}
    assert choose(by, replicas, {"high-0": pending}) is None, why


def test_priority_is_checked() -> None:
    for bad in (True, 1.5, "high", 10**7):
        with pytest.raises(DeploymentError, match="priority"):
            dep("x", bad, 1)  # type: ignore[arg-type]
    assert "priority" not in dep("x", 0, 1).plain()
    d = dep("x", -3, 1)
    assert parse_deployment(d.plain(), "t") == d
    assert d.template_hash() == evolve(d, priority=7).template_hash()  # rolls nothing


def test_a_take_waits_for_the_takers_next_replica_or_the_retry() -> None:
    a = Autoscaler()
    high, low = dep("high", 10, 2), auto("low", 1, 4, 1)
    ds = {"high": high, "low": low}
    rs = {**reps(high, R, P), **reps(low, R, R, R, R)}
    first = a.preemption(0.0, ds, rs, {"high-1": NO_GPUS})
    assert first is not None and (first.deployment, first.after) == ("low", 3)
    assert first.also is not None and first.also[0] == "high"
    ds["low"] = evolve(low, replicas=3)
    rs = {**reps(high, R, P), **reps(low, R, R, R)}  # the drain is over, high-1 still pending
    assert a.preemption(5.0, ds, rs, {"high-1": NO_GPUS}) is None  # its GPUs may be coming
    assert a.preemption(PREEMPT_RETRY, ds, rs, {"high-1": NO_GPUS}) is not None
    # Placed since: it may take again at once for a further replica.
    a2 = Autoscaler()
    assert a2.preemption(0.0, ds, rs, {"high-1": NO_GPUS}) is not None
    ds3 = {"high": evolve(high, replicas=3), "low": evolve(low, replicas=2)}
    rs3 = {**reps(ds3["high"], R, R, P), **reps(ds3["low"], R, R)}
    assert a2.preemption(1.0, ds3, rs3, {"high-2": NO_GPUS}) is not None

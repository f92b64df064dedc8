"""autoscale.sleep_when_idle (issue 25): the setting, strictly parsed; part of the engine
(template_hash); vLLM's plans start with sleep mode and the dev-mode endpoints; the
simulated engine reads the same flag and variable."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
import trio
from attrs import evolve

from fakes.cluster import cluster, node
from llmgw.agent.engines import build_plan
from llmgw.agent.engines.vllm import DEV_MODE_ENV, SLEEP_FLAG
from llmgw.agent.lifecycle import sleep as engine_sleep
from llmgw.config.agent import AgentConfig, EnginesConfig, KeysConfig, VllmConfig
from llmgw.config.deployment import parse_deployment
from llmgw.errors import DeploymentError, UsageError
from llmgw.model.deployment import Deployment, Member, Replica, ReplicaState
from llmgw.model.engine import EngineKind, EngineReport, EngineSpec, EngineState, GangSpec
from llmgw.server.elastic.autoscaler import _sleep_instead
from llmgw.server.reconcile.rules import desired_sets, reconcile
from llmgw.server.reconcile.sleeping import serving
from llmgw.simengine.args import parse_args

AUTO = {"min": 0, "max": 2, "in_flight_per_replica": 4, "idle_to_zero": "10m"}
IDX = {"GPU-aaaa": 0}


def deployment(engine: str = "vllm", **auto: Any) -> dict[str, Any]:
    return {"name": "a", "model": "org/m", "engine": engine, "gpus_per_node": 1, "replicas": 1,
            "autoscale": {**AUTO, **auto}}


def test_sleep_when_idle_parses_round_trips_and_rolls_the_engines() -> None:
    d = parse_deployment(deployment(sleep_when_idle=True), "a.yaml")
    assert d.autoscale is not None and d.autoscale.sleep_when_idle and d.sleep_mode
    assert parse_deployment(d.plain(), "again") == d
    off = parse_deployment(deployment(), "a.yaml")
    assert not off.sleep_mode and "sleep_when_idle" not in off.plain()["autoscale"]
    # vLLM takes sleep mode only at start: the flag shapes the engine, so it rolls...
    assert d.template_hash() != off.template_hash()
    # ... while the rest of autoscale does not, and off leaves every hash from before.
    assert off.template_hash() == parse_deployment({**deployment(), "autoscale": None}, "a").template_hash()
    member = (Member("n1", 0, ("GPU-a",), 20001, "10.0.0.1"),)
    assert [s.sleep_mode for s in Replica("a-0", "a", 0, d, members=member).engine_specs()] == [True]
    assert [s.sleep_mode for s in Replica("a-0", "a", 0, off, members=member).engine_specs()] == [False]
    assert parse_deployment(deployment("simulated", sleep_when_idle=True), "a.yaml").sleep_mode


@pytest.mark.parametrize(("data", "key", "words"), [
    (deployment(sleep_when_idle="yes"), "autoscale.sleep_when_idle", "true or false"),
    ({**deployment(sleep_when_idle=True), "autoscale": {"max": 2, "in_flight_per_replica": 4,
                                                        "sleep_when_idle": True}},
     "autoscale.sleep_when_idle", "needs idle_to_zero"),
    (deployment("sglang", sleep_when_idle=True), "autoscale.sleep_when_idle", "vLLM engines only"),
])
def test_bad_sleep_settings_are_one_line(data: dict[str, Any], key: str, words: str) -> None:
    with pytest.raises(DeploymentError) as info:
        parse_deployment(data, "deploy/a.yaml")
    assert info.value.key == key and words in str(info.value) and info.value.exit_code == 2
    assert "\n" not in str(info.value)


def _config() -> AgentConfig:
    return AgentConfig(node_id="n1", server="tcp://10.0.0.9:5555", keys=KeysConfig("s", "p"),
                       mgmt_addr="10.0.0.2",
                       engines=EnginesConfig(vllm=VllmConfig(bin="/opt/vllm/bin/vllm", launch_mode="mp"),
                                             simulated_python="/usr/bin/python3"))


def _spec(kind: EngineKind, rank: int | None = None, sleep: bool = True, **kw: Any) -> EngineSpec:
    gang = None if rank is None else GangSpec(2, rank, "10.0.0.1", 29600)
    return EngineSpec("r1", 1, "a", "/models/m", "a", kind, ("GPU-aaaa",), 20001, gang=gang,
                      sleep_mode=sleep, **kw)


@pytest.mark.parametrize("rank", [None, 0, 1])
@pytest.mark.parametrize("kind", [EngineKind.VLLM, EngineKind.SIMULATED])
def test_plans_start_with_sleep_mode_and_its_endpoints(kind: EngineKind, rank: int | None) -> None:
    plan = build_plan(_spec(kind, rank), _config(), "/w", gpu_indices=IDX)
    assert SLEEP_FLAG in plan.main.argv and plan.main.env[DEV_MODE_ENV] == "1"
    plain = build_plan(_spec(kind, rank, sleep=False), _config(), "/w", gpu_indices=IDX)
    assert SLEEP_FLAG not in plain.main.argv and DEV_MODE_ENV not in plain.main.env


def test_dev_mode_wins_over_the_deployments_env() -> None:
    """Sleep mode without the endpoints frees nothing llmgw can ask for."""
    plan = build_plan(_spec(EngineKind.VLLM, env={DEV_MODE_ENV: "0"}), _config(), "/w", gpu_indices=IDX)
    assert plan.main.env[DEV_MODE_ENV] == "1"


def test_the_simulated_engine_reads_the_flag_and_dev_mode_as_vllm_does() -> None:
    a = parse_args(["serve", "m", "--enable-sleep-mode"], {DEV_MODE_ENV: "1"})
    assert a.sleep_mode and a.dev_mode and a.unknown == ()
    b = parse_args(["serve", "m"], {DEV_MODE_ENV: "0"})
    assert not b.sleep_mode and not b.dev_mode
    assert parse_args(["serve", "m"], {DEV_MODE_ENV: "2"}).dev_mode  # bool(int(value))
    with pytest.raises(UsageError, match="VLLM_SERVER_DEV_MODE must be an integer"):
        parse_args(["serve", "m"], {DEV_MODE_ENV: "true"})


# ---- the server's side: the autoscaler's rule, the replicas in place, the table ----

def _sleepy(**kw: Any) -> Deployment:
    return evolve(parse_deployment(deployment(sleep_when_idle=True), "a.yaml"), **kw)


def test_idle_sleeps_instead_of_zero_and_requests_wake_it() -> None:
    d = _sleepy()
    reason = "no request for 600s (idle_to_zero 600s): to zero"
    handled, c = _sleep_instead(d, 0, reason, active=False)
    assert handled and c is not None and (c.before, c.after, c.asleep) == (1, 1, True)
    assert c.reason == "no request for 600s (idle_to_zero 600s): asleep (sleep_when_idle)"
    assert c.direction == "sleep"
    asleep = evolve(d, asleep=True)
    assert _sleep_instead(asleep, 0, reason, active=False) == (True, None)  # stays, never to 0
    handled, c = _sleep_instead(asleep, 1, "", active=True)
    assert handled and c is not None and (c.after, c.asleep, c.direction) == (1, False, "wake")
    assert c.reason == "woken from sleep by requests"
    handled, c = _sleep_instead(asleep, 2, "scaled up 1 -> 2: ...", active=True)
    assert handled and c is not None and (c.after, c.asleep, c.direction) == (2, False, "up")
    # Awake with load: decide()'s count, as without the setting; and without the setting
    # or at zero already, the rule is out of the way.
    assert _sleep_instead(d, 2, "up", active=True) == (False, None)
    assert _sleep_instead(parse_deployment(deployment(), "a"), 0, reason, active=False) == (False, None)
    assert _sleep_instead(evolve(d, replicas=0), 0, reason, active=False) == (False, None)


def _ready(replicas: dict) -> dict[str, list[EngineReport]]:
    return {m.node_id: [EngineReport(r.id, r.generation, EngineState.READY)]
            for r in replicas.values() for m in r.members}


def test_replicas_take_asleep_in_place_and_leave_the_table() -> None:
    nodes = cluster(node("a", 1))
    d = _sleepy()
    res = reconcile({"a": d}, {}, nodes, {}, 1000.0)
    res = reconcile({"a": d}, res.replicas, nodes, _ready(res.replicas), 1001.0,
                    generation_floor=res.generation_floor)
    (before,) = res.replicas.values()
    assert before.state == ReplicaState.READY and serving(before)
    for t, want in ((1002.0, True), (1003.0, False)):
        res = reconcile({"a": evolve(d, asleep=want)}, res.replicas, nodes, _ready(res.replicas), t,
                        generation_floor=res.generation_floor)
        (r,) = res.replicas.values()
        # Same generation: the agent sleeps or wakes the running engine, no restart.
        assert (r.generation, r.state, r.spec.asleep, serving(r)) == (before.generation, ReplicaState.READY,
                                                                      want, not want)
        ((spec,),) = desired_sets(res.replicas.values()).values()
        assert (spec.asleep, spec.sleep_mode, spec.generation) == (want, True, before.generation)
    assert parse_deployment(evolve(d, asleep=True).plain(), "wire").asleep  # stored as it travels
    with pytest.raises(DeploymentError, match="asleep: needs autoscale.sleep_when_idle"):
        parse_deployment({**deployment(), "asleep": True}, "a.yaml")


async def test_sleep_and_wake_read_only_the_status_as_vllm_before_0_32_answers() -> None:
    """vLLM before 0.32 (api_server.py, then entrypoints/serve/sleep/api_router.py) answers
    POST /sleep and /wake_up with an empty 200; only /is_sleeping has a body."""
    asleep = False
    seen: list[str] = []

    async def old_vllm(stream: trio.SocketStream) -> None:
        nonlocal asleep
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = await stream.receive_some(4096)
            if not chunk:
                return
            head += chunk
        method, target = head.split(b" ", 2)[:2]
        path = target.decode().split("?", 1)[0]
        seen.append(f"{method.decode()} {path}")
        body = b""
        if path == "/sleep":
            asleep = True
        elif path == "/wake_up":
            asleep = False
        elif path == "/is_sleeping":
            body = json.dumps({"is_sleeping": asleep}).encode()
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, old_vllm, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        with trio.fail_after(10):
            await engine_sleep.sleep("127.0.0.1", port, timeout=5)
            assert asleep
            await engine_sleep.wake("127.0.0.1", port, timeout=5)
        assert not asleep
        nursery.cancel_scope.cancel()
    assert seen == ["POST /sleep", "POST /wake_up", "GET /is_sleeping"]

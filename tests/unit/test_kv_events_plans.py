"""KV-cache events on the engine side: the deployment setting (strict, in template_hash,
carried to the engine spec and omitted from the wire when off), the launch plans' events
config (vLLM's and SGLang's shapes, rank 0 only, loopback ports of the engine block) and
the apply-time refusals of args that would undo it."""

from __future__ import annotations

import json
from typing import Any

import attrs
import msgpack
import pytest

from llmgw.agent.engines import build_plan
from llmgw.agent.engines.preflight import local_port
from llmgw.config.agent import AgentConfig, EnginesConfig, KeysConfig, SglangConfig, VllmConfig
from llmgw.config.deployment import parse_deployment
from llmgw.config.vllm_serve import apply_refusal
from llmgw.errors import DeploymentError, EngineError
from llmgw.model.deployment import ENGINE_PORT_BLOCK, Member, Replica
from llmgw.model.engine import EngineKind, EngineSpec, GangSpec
from llmgw.transport.codec import converter

BASE = {"name": "a", "model": "org/m", "engine": "vllm", "gpus_per_node": 2, "replicas": 1}
IDX = {"GPU-aaaa": 0, "GPU-bbbb": 1}
BLOCK = 30000


def config(mode: str = "mp") -> AgentConfig:
    return AgentConfig(node_id="n1", server="tcp://10.0.0.9:5555", keys=KeysConfig("s", "p"),
                       mgmt_addr="10.0.0.2",
                       engines=EnginesConfig(vllm=VllmConfig(bin="/opt/vllm/bin/vllm", launch_mode=mode,
                                                             ray_bin="/opt/vllm/bin/ray"),
                                             sglang=SglangConfig(python="/opt/sglang/bin/python")))


def spec(kind: EngineKind = EngineKind.VLLM, rank: int | None = None, **kw: Any) -> EngineSpec:
    gang = None if rank is None else GangSpec(2, rank, "10.0.0.1", 29600, ray_port=26379,
                                              ray_port_base=27000)
    base = EngineSpec("r1", 3, "a", "org/m", "m", kind, ("GPU-aaaa", "GPU-bbbb"), 20001,
                      tensor_parallel=2, port_base=BLOCK, args=("--max-model-len", "512"),
                      gang=gang, kv_events=True)
    return attrs.evolve(base, **kw)


def events_config(argv: tuple[str, ...]) -> dict[str, object] | None:
    if "--kv-events-config" not in argv:
        return None
    assert argv.count("--kv-events-config") == 1
    cfg: dict[str, object] = json.loads(argv[argv.index("--kv-events-config") + 1])
    return cfg


# ------------------------------------------------------------- the setting


def test_kv_events_parses_strictly_round_trips_and_rolls_the_engines() -> None:
    on = parse_deployment({**BASE, "kv_events": True}, "a.yaml")
    off = parse_deployment(BASE, "a.yaml")
    assert on.kv_events and not off.kv_events
    assert parse_deployment(on.plain(), "again") == on
    assert "kv_events" not in off.plain()
    # A flag at the engine's start: turning it on rolls; off leaves every hash from before.
    assert on.template_hash() != off.template_hash()
    assert parse_deployment({**BASE, "kv_events": False}, "a").template_hash() == off.template_hash()
    member = (Member("n1", 0, ("GPU-a",), 20001, "10.0.0.1", port_base=BLOCK),)
    assert [s.kv_events for s in Replica("a-0", "a", 0, on, members=member).engine_specs()] == [True]
    assert [s.kv_events for s in Replica("a-0", "a", 0, off, members=member).engine_specs()] == [False]
    assert parse_deployment({**BASE, "engine": "sglang", "kv_events": True}, "a").kv_events


@pytest.mark.parametrize(("data", "words"), [
    ({**BASE, "kv_events": "yes"}, "true or false"),
    ({**BASE, "kv_events": 1}, "true or false"),
    ({**BASE, "engine": "simulated", "kv_events": True}, "vLLM and SGLang engines only"),
])
def test_kv_events_refuses_what_it_cannot_be(data: dict[str, object], words: str) -> None:
    with pytest.raises(DeploymentError, match=words) as err:
        parse_deployment(data, "a.yaml")
    assert "kv_events" in str(err.value)


def test_the_wire_carries_kv_events_only_when_on() -> None:
    """A desired set without it is what it was before the key: an agent from before,
    whose converter forbids extra keys, still reads it."""
    off = attrs.evolve(spec(), kv_events=False)
    assert "kv_events" not in converter.unstructure(off)
    assert converter.unstructure(spec())["kv_events"] is True
    wire = msgpack.unpackb(msgpack.packb(converter.unstructure(spec())))
    assert converter.structure(wire, EngineSpec) == spec()


# ------------------------------------------------------------- launch plans


def test_vllm_single_node_publishes_to_loopback_ports_of_its_block() -> None:
    argv = build_plan(spec(), config(), "/w", gpu_indices=IDX).main.argv
    cfg = events_config(argv)
    assert cfg == {"enable_kv_cache_events": True, "publisher": "zmq",
                   "endpoint": f"tcp://127.0.0.1:{BLOCK + 13}",
                   "replay_endpoint": f"tcp://127.0.0.1:{BLOCK + 14}", "topic": "r1"}
    # Before the deployment's own args.
    assert argv.index("--kv-events-config") < argv.index("--max-model-len")


def test_the_event_ports_stay_clear_of_the_blocks_other_users() -> None:
    """Inside the block; not VLLM_PORT's start, where vLLM's walk takes its first port, nor
    the single-node pre-flight's rendezvous port; SGLang's ports are the bottom eight."""
    s = spec()
    env = build_plan(s, config(), "/w", gpu_indices=IDX).main.env
    cfg = events_config(build_plan(s, config(), "/w", gpu_indices=IDX).main.argv)
    assert cfg is not None
    ports = {int(str(cfg[k]).rsplit(":", 1)[1]) for k in ("endpoint", "replay_endpoint")}
    assert len(ports) == 2 and ports <= set(range(BLOCK, BLOCK + ENGINE_PORT_BLOCK))
    assert int(env["VLLM_PORT"]) not in ports and local_port(s) not in ports
    assert min(ports) >= BLOCK + 8


def test_off_adds_nothing() -> None:
    for kind in (EngineKind.VLLM, EngineKind.SGLANG):
        argv = build_plan(spec(kind, kv_events=False), config(), "/w", gpu_indices=IDX).main.argv
        assert events_config(argv) is None


def test_vllm_gangs_give_it_to_rank_0_alone() -> None:
    """The scheduler publishes; a headless mp rank runs workers only, a Ray worker only Ray."""
    head = build_plan(spec(rank=0), config("mp"), "/w", gpu_indices=IDX).main.argv
    member = build_plan(spec(rank=1), config("mp"), "/w", gpu_indices=IDX).main.argv
    assert events_config(head) is not None and events_config(member) is None
    ray_head = build_plan(spec(rank=0), config("ray"), "/w", gpu_indices=IDX)
    ray_worker = build_plan(spec(rank=1), config("ray"), "/w", gpu_indices=IDX)
    assert events_config(ray_head.main.argv) is not None
    assert all(events_config(p.argv) is None for p in ray_worker.processes)
    assert all(events_config(p.argv) is None for p in ray_head.processes if p is not ray_head.main)


def test_sglang_gets_its_own_shape_on_rank_0() -> None:
    argv = build_plan(spec(EngineKind.SGLANG), config(), "/w", gpu_indices=IDX).main.argv
    assert events_config(argv) == {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{BLOCK + 13}",
                                   "replay_endpoint": f"tcp://127.0.0.1:{BLOCK + 14}", "topic": "r1"}
    assert argv.index("--kv-events-config") < argv.index("--max-model-len")
    member = build_plan(spec(EngineKind.SGLANG, rank=1), config(), "/w", gpu_indices=IDX).main.argv
    assert events_config(member) is None


def test_no_block_no_events_ports() -> None:
    with pytest.raises(EngineError, match="port block"):
        build_plan(spec(port_base=0), config(), "/w", gpu_indices=IDX)


# ------------------------------------------------------------- refused at apply


@pytest.mark.parametrize(("engine", "args", "words"), [
    ("vllm", ["--kv-events-config", "{}"], "leave it out of args"),
    ("vllm", ['--kv_events_config={"publisher": "null"}'], "leave it out of args"),
    ("sglang", ["--kv-events-config", "{}"], "leave it out of args"),
    ("vllm", ["--data-parallel-size", "2"], "data parallelism"),
    ("vllm", ["-dp", "4"], "data parallelism"),
    ("sglang", ["--dp-size", "2"], "data parallelism"),
    ("sglang", ["--attention-data-parallel-size=2"], "data parallelism"),
])
def test_args_that_undo_kv_events_are_refused_at_apply(engine: str, args: list[str], words: str) -> None:
    on = parse_deployment({**BASE, "engine": engine, "args": args, "kv_events": True}, "a")
    assert words in apply_refusal(on)
    # Without kv_events they are the operator's own business.
    assert apply_refusal(parse_deployment({**BASE, "engine": engine, "args": args}, "a")) == ""


def test_one_rank_is_accepted() -> None:
    for engine, args in (("vllm", ["-dp", "1"]), ("sglang", ["--dp-size", "1"]), ("vllm", [])):
        assert apply_refusal(parse_deployment({**BASE, "engine": engine, "args": args,
                                               "kv_events": True}, "a")) == ""

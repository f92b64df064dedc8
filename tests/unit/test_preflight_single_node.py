"""The pre-flight of a single-node tensor-parallel replica (issue 22), as data: asked for
explicitly by the deployment (never by default), carried by EngineSpec.preflight*, planned
as one node's world of its GPUs meeting on 127.0.0.1 at a port of the replica's own, with
no fabric floor; a failure places the replica on another node and avoids this one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from test_preflight import config
from test_reconcile import dep
from test_reconcile_preflight import SLOW, preflight_tail

from fakes.cluster import cluster, node
from llmgw.agent.engines import build_plan
from llmgw.agent.engines.preflight import PROBE_ENV, RESULT_FILE, parse_output, settings_of
from llmgw.agent.insession import preflight_probe
from llmgw.agent.lifecycle.preflight_report import result_path
from llmgw.agent.process.spawn import default_plan
from llmgw.config.agent import FabricConfig
from llmgw.config.deployment import parse_deployment
from llmgw.ctl.render import _describe_node
from llmgw.model.deployment import ENGINE_PORT_BLOCK, Member, Replica, ReplicaState
from llmgw.model.engine import EngineKind, EngineReport, EngineSpec, EngineState
from llmgw.model.preflight import AVOID_SECONDS, EXIT_CODE
from llmgw.server.reconcile.rules import NodeDelta, ReconcileState, reconcile_dirty
from llmgw.server.status import local_preflight

BASE = {"name": "x", "model": "m", "engine": "vllm", "gpus_per_node": 2, "replicas": 1}


@pytest.mark.parametrize("extra, mode", [
    ({}, ""),  # unset: none on one node (a gang's default stays required)
    ({"preflight": "required"}, "required"),
    ({"preflight": "best_effort"}, "best_effort"),
    ({"preflight": "off"}, ""),
    ({"preflight": True}, "required"),  # YAML's bare `on`
    ({"preflight": "required", "engine": "simulated"}, "required"),
    # One GPU on one node: accepted, nothing to probe (model/deployment.py says why).
    ({"preflight": "required", "gpus_per_node": 1}, ""),
    ({"nodes": 2}, "required"),
])
def test_one_node_runs_it_only_when_asked(extra: dict[str, object], mode: str) -> None:
    assert parse_deployment({**BASE, **extra}, "t").preflight_mode == mode


def test_the_engine_spec_carries_it_and_a_gang_member_keeps_its_own() -> None:
    d = parse_deployment({**BASE, "preflight": "best_effort", "preflight_timeout": "20s",
                          "preflight_min_busbw": 30}, "t")
    r = Replica("x-0", "x", 0, d, members=(Member("n1", 0, ("GPU-a", "GPU-b"), 20001, "10.0.0.2",
                                                  port_base=20100),))
    (s,) = r.engine_specs()
    assert (s.preflight, s.preflight_timeout, s.preflight_min_busbw) == ("best_effort", 20.0, 30.0)
    plain = Replica("x-0", "x", 0, parse_deployment(BASE, "t"), members=r.members).engine_specs()[0]
    assert (plain.preflight, plain.preflight_timeout, plain.preflight_min_busbw) == ("", 60.0, 0.0)
    g = parse_deployment({**BASE, "nodes": 2, "preflight": "best_effort"}, "t")
    members = (Member("n1", 0, ("GPU-a",), 20001, "10.0.0.2", rendezvous_port=29600),
               Member("n2", 1, ("GPU-c",), 20001, "10.0.0.3", rendezvous_port=29600))
    for gs in Replica("g-0", "g", 0, g, members=members).engine_specs():
        assert gs.preflight == "" and gs.gang is not None and gs.gang.preflight == "best_effort"


def spec(gpus: tuple[str, ...] = ("GPU-a", "GPU-b"), preflight: str = "required",
         engine: EngineKind = EngineKind.VLLM, port_base: int = 20100) -> EngineSpec:
    return EngineSpec("r1", 1, "d", "/m", "m", engine, gpus, 20001, tensor_parallel=len(gpus),
                      port_base=port_base, preflight=preflight, preflight_timeout=45.0,
                      preflight_min_busbw=20.0)


def test_the_plan_is_one_nodes_world_of_its_gpus_on_loopback(tmp_path: Path) -> None:
    # A fabric the node has, at a known rate: on one node it sets no floor (NVLink is not it).
    cfg = attrs.evolve(config(tmp_path), fabrics=(FabricConfig("ib", ("mlx5_0",), rate_gbps=400.0),))
    plan = build_plan(spec(), cfg, "/w", gpu_indices={"GPU-a": 3, "GPU-b": 5},
                      probe=("/opt/vllm/bin/python", "/p/probe.py"))
    pre = plan.preflight
    assert pre is not None and pre.required and pre.timeout == 45.0
    assert pre.min_busbw_gbps == 20.0 and pre.nccl_floor_gbps == 0.0
    assert pre.result_path == f"/w/engines/r1/{RESULT_FILE}"
    settings = json.loads(pre.process.env.pop(PROBE_ENV))
    assert pre.process.env == plan.main.env and plan.main.env["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert "NCCL_IB_HCA" not in plan.main.env  # no fabric crossed
    assert {k: settings[k] for k in ("nnodes", "node_rank", "master_addr", "master_port",
                                     "local_ranks", "timeout")} == {
        "nnodes": 1, "node_rank": 0, "master_addr": "127.0.0.1",
        "master_port": 20100 + ENGINE_PORT_BLOCK - 1, "local_ranks": 2, "timeout": 45.0}
    # The simulated engine has no port block: its own HTTP port, free until it starts.
    sim = settings_of(spec(engine=EngineKind.SIMULATED, port_base=0))
    assert sim is not None and sim.master_port == 20001 and sim.local_ranks == 2
    best = build_plan(spec(preflight="best_effort"), cfg, "/w", gpu_indices={"GPU-a": 3, "GPU-b": 5},
                      probe=("py", "p"))
    assert best.preflight is not None and not best.preflight.required


def test_none_without_the_setting_or_with_one_gpu(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    idx = {"GPU-a": 0, "GPU-b": 1}
    assert build_plan(spec(preflight=""), cfg, "/w", gpu_indices=idx, probe=("py", "p")).preflight is None
    one = spec(gpus=("GPU-a",))
    assert build_plan(one, cfg, "/w", gpu_indices=idx, probe=("py", "p")).preflight is None
    assert result_path("/w/engines/r1", one) == "" and result_path("/w/engines/r1", spec(preflight="")) == ""
    assert result_path("/w/engines/r1", spec()) == f"/w/engines/r1/{RESULT_FILE}"
    # The agent's plan function names the probe for it (engines.preflight_* as for a gang).
    told = config(tmp_path, preflight_python="/t/py", preflight_probe="/t/fake.py")
    plan = default_plan(told, "/agent/python")(spec(), idx)
    assert plan.preflight is not None and plan.preflight.process.argv == ("/t/py", "/t/fake.py")
    assert default_plan(told, "/agent/python")(spec(preflight=""), idx).preflight is None


def test_a_failed_probe_places_it_on_another_node_and_avoids_this_one() -> None:
    nodes = cluster(node("a", 2), node("b", 2))
    state = ReconcileState(nodes)
    deps = {"d": dep(1, gpus=2, preflight="required")}
    now = 1000.0
    res = reconcile_dirty(state, deps, now)
    r = state.replicas["d-0"]
    first, gen = r.node_ids[0], r.generation
    rep = EngineReport(r.id, r.generation, EngineState.STARTING, preflight="running")
    state.node(NodeDelta(first, nodes[first], (rep,)))
    now += 1
    res = reconcile_dirty(state, deps, now)
    assert state.replicas["d-0"].state == ReplicaState.PREFLIGHT
    rep = EngineReport(r.id, r.generation, EngineState.EXITED, exit_code=EXIT_CODE,
                       log_tail=preflight_tail(SLOW), preflight=f"failed: {SLOW}")
    state.node(NodeDelta(first, nodes[first], (rep,)))
    now += 1
    res = reconcile_dirty(state, deps, now)
    r = state.replicas["d-0"]
    assert r.placed and r.node_ids != (first,) and r.generation > gen and r.restarts == 1
    assert r.state == ReplicaState.STARTING and set(state.avoid) == {first}
    assert any(e.text.startswith(f"pre-flight failed on {first} (its GPUs' links on one node): "
                                 f"{SLOW}; avoiding them for {AVOID_SECONDS:g}s")
               for e in res.events), [e.text for e in res.events]


def test_a_replica_without_a_probe_does_not_avoid_the_node() -> None:
    nodes = cluster(node("a", 2))
    state = ReconcileState(nodes)
    state.avoid["a"] = 5000.0  # a probed replica's pre-flight failed there lately
    reconcile_dirty(state, {"d": dep(1, gpus=2)}, 1000.0)
    assert state.replicas["d-0"].node_ids == ("a",)
    probed = ReconcileState(nodes)
    probed.avoid["a"] = 5000.0
    reconcile_dirty(probed, {"d": dep(1, gpus=2, preflight="required")}, 1000.0)
    assert not probed.replicas["d-0"].placed


def test_describe_node_keeps_the_last_passed_single_node_figure() -> None:
    d = parse_deployment({**BASE, "preflight": "required"}, "t")

    def placed(rid: str, at: float, line: str, busbw: float) -> tuple[Replica, dict[str, EngineReport]]:
        r = Replica(rid, "x", 0, d, members=(Member("n1", 0, ("GPU-a", "GPU-b"), 20001),), placed_at=at)
        return r, {"n1": EngineReport(rid, 1, EngineState.READY, preflight=line, preflight_busbw_gbps=busbw)}

    passed = "passed: nccl x2, 256 MiB at 350 GB/s bus bandwidth, in 3.0s"
    got = local_preflight([placed("x-0", 10.0, passed, 350.0), placed("x-1", 20.0, "running", 0.0),
                           placed("x-2", 5.0, passed, 300.0)])
    assert got == {"replica": "x-0", "busbw_gbps": 350.0, "line": passed}
    assert local_preflight([placed("x-1", 20.0, "failed: boom", 0.0)]) == {}
    text = _describe_node({"id": "n1", "state": "ready", "heartbeat_age": 0, "gpus": [], "preflight_gpus": got})
    assert "pre-flight on its GPUs: 350 GB/s bus bandwidth (x-0, one node)" in text


FAKE_TORCH = """class cuda:
    @staticmethod
    def is_available():
        return True

    @staticmethod
    def device_count():
        return 1
"""


def test_the_probe_fails_when_torch_sees_other_gpus_than_the_replicas(tmp_path: Path) -> None:
    # A stand-in torch that sees one GPU where the replica has two (CUDA_VISIBLE_DEVICES
    # not the replica's): the probe says so before any rank starts.
    (tmp_path / "torch.py").write_text(FAKE_TORCH)
    cfg = {"nnodes": 1, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": 1,
           "gpu_sizes": [1], "gpu_iters": 1, "cpu_sizes": [1], "cpu_iters": 1, "timeout": 5,
           "local_ranks": 2}
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(tmp_path),
           PROBE_ENV: json.dumps(cfg), "CUDA_VISIBLE_DEVICES": "3"}
    p = subprocess.run([sys.executable, preflight_probe.__file__], env=env, capture_output=True,
                       text=True, timeout=30)
    r = parse_output(p.stdout)
    assert p.returncode == 1 and not r.ok and r.backend == "nccl", (p.stdout, p.stderr)
    assert r.error == "torch sees 1 GPU (CUDA_VISIBLE_DEVICES='3'), the replica has 2"

"""The pre-flight (issue 22), agent side: what a gang member's plan runs before its engine,
how the probe's output is read and judged, and the launcher refusing to start an engine
whose required pre-flight failed or hung."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.engines import build_plan
from llmgw.agent.engines.preflight import (
    CPU_SIZES,
    GPU_SIZES,
    PROBE_ENV,
    ProbeResult,
    parse_output,
    verdict,
)
from llmgw.agent.insession import preflight_run
from llmgw.agent.process.spawn import default_plan, probe_command, spawn_plan
from llmgw.config.agent import AgentConfig, EnginesConfig, KeysConfig, SupervisorConfig, VllmConfig
from llmgw.config.deployment import parse_deployment
from llmgw.model.engine import EngineKind, EngineSpec, GangSpec

GOOD = {"ok": True, "backend": "gloo", "world": 2, "seconds": 2.5, "results": [
    {"bytes": 65536, "seconds": 0.002, "algbw_gbps": 0.03, "busbw_gbps": 0.03},
    {"bytes": 4194304, "seconds": 0.004, "algbw_gbps": 1.0, "busbw_gbps": 1.0},
]}


def line(doc: object) -> str:
    return f"LLMGW_PREFLIGHT {json.dumps(doc)}"


def test_parse_a_passing_probe() -> None:
    r = parse_output(f"noise\n{line({'ok': False})}\n{line(GOOD)}\ntrailing\n")
    assert r.ok and r.backend == "gloo" and r.world == 2 and r.busbw_gbps == 1.0
    assert r.line() == "passed: gloo x2, 4 MiB at 1 GB/s bus bandwidth, in 2.5s"
    assert verdict(r, 0.5) == r
    slow = verdict(r, 5)
    assert not slow.ok and slow.error == "bus bandwidth 1 GB/s is below 5 GB/s"
    assert slow.line() == "failed: bus bandwidth 1 GB/s is below 5 GB/s"


@pytest.mark.parametrize("text, why", [
    ("", "the probe printed no result"),
    ("LLMGW_PREFLIGHT {nope", "unreadable result"),
    ("LLMGW_PREFLIGHT [1]", "unreadable result: not an object"),
    (line({"ok": False, "error": "RuntimeError: Connection refused"}), "RuntimeError: Connection refused"),
    (line({"ok": True, "world": "2"}), "unreadable result: world is '2'"),
    (line({**GOOD, "results": [{"bytes": 1}]}), "unreadable result: seconds is None"),
])
def test_parse_failures_say_why(text: str, why: str) -> None:
    r = parse_output(text)
    assert not r.ok and r.error.startswith(why)


@given(st.text())
def test_parse_is_total(text: str) -> None:
    assert isinstance(parse_output(text), ProbeResult)
    assert isinstance(parse_output("LLMGW_PREFLIGHT " + text), ProbeResult)


def config(tmp_path: Path, mode: str = "mp", **engines: str) -> AgentConfig:
    return AgentConfig(node_id="n1", server="tcp://10.0.0.9:5555", keys=KeysConfig("s", "p"),
                       mgmt_addr="10.0.0.2", mgmt_interface="eno1",
                       engines=EnginesConfig(vllm=VllmConfig(bin="/opt/vllm/bin/vllm", launch_mode=mode),
                                             **engines),
                       supervisor=SupervisorConfig(work_dir=str(tmp_path)))


def spec(preflight: str = "required", gpus: tuple[str, ...] = ("GPU-a",), rank: int = 1,
         engine: EngineKind = EngineKind.VLLM) -> EngineSpec:
    gang = GangSpec(2, rank, "10.0.0.1", 29600, ("mlx5_0",), ray_port=26379, ray_port_base=27000,
                    preflight=preflight, preflight_timeout=45.0, preflight_min_busbw=20.0)
    return EngineSpec("r1", 1, "d", "/m", "m", engine, gpus, 20001, port_base=20100, gang=gang)


def test_a_gang_members_plan_runs_the_probe_with_the_engines_environment(tmp_path: Path) -> None:
    plan = build_plan(spec(), config(tmp_path), "/w", gpu_indices={"GPU-a": 3},
                      probe=("/opt/vllm/bin/python", "/p/probe.py"))
    pre = plan.preflight
    assert pre is not None and pre.required and pre.timeout == 45.0 and pre.min_busbw_gbps == 20.0
    assert pre.process.argv == ("/opt/vllm/bin/python", "/p/probe.py")
    assert pre.result_path == "/w/engines/r1/preflight.json"
    settings = json.loads(pre.process.env.pop(PROBE_ENV))
    # The engine's env (CUDA_VISIBLE_DEVICES, NCCL_*, GLOO_*, ...), with NCCL's INFO lines
    # on: the gang has HCAs, and the launcher reads which network NCCL crossed nodes on.
    assert pre.process.env == {**plan.main.env, "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
    assert plan.main.env["CUDA_VISIBLE_DEVICES"] == "3" and plan.main.env["NCCL_IB_HCA"] == "=mlx5_0"
    assert settings == {"nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 29600,
                        "gpu_sizes": list(GPU_SIZES), "gpu_iters": 5, "cpu_sizes": list(CPU_SIZES),
                        "cpu_iters": 3, "timeout": 45.0, "hcas": ["mlx5_0"]}
    assert GPU_SIZES == (1 << 20, 16 << 20, 256 << 20)  # 1 MiB to 256 MiB, as issue 22 asks
    best = build_plan(spec("best_effort"), config(tmp_path), "/w", gpu_indices={"GPU-a": 3}, probe=("py", "p"))
    assert best.preflight is not None and not best.preflight.required
    # None asked for, a single node, or no probe given: no pre-flight.
    assert build_plan(spec(""), config(tmp_path), "/w", gpu_indices={"GPU-a": 3}, probe=("py", "p")).preflight is None
    single = attrs.evolve(spec(), gang=None)
    assert build_plan(single, config(tmp_path), "/w", gpu_indices={"GPU-a": 3}, probe=("py", "p")).preflight is None
    assert build_plan(spec(), config(tmp_path), "/w", gpu_indices={"GPU-a": 3}).preflight is None


def test_the_probe_runs_under_the_engines_python(tmp_path: Path) -> None:
    vllm = tmp_path / "vllm"
    vllm.write_text("#!/opt/venv/bin/python3.12\nimport sys\n")
    vllm.chmod(0o755)
    cfg = attrs.evolve(config(tmp_path), engines=EnginesConfig(vllm=VllmConfig(bin=str(vllm))))
    assert probe_command(spec(), cfg, "/agent/python")[0] == "/opt/venv/bin/python3.12"
    assert probe_command(spec(), cfg, "/agent/python")[1].endswith("llmgw/agent/insession/preflight_probe.py")
    sg = attrs.evolve(cfg, engines=attrs.evolve(cfg.engines, sglang=attrs.evolve(cfg.engines.sglang, python="/sg/py")))
    assert probe_command(spec(engine=EngineKind.SGLANG), sg, "/agent/python")[0] == "/sg/py"
    assert probe_command(spec(engine=EngineKind.SIMULATED), cfg, "/agent/python")[0] == "/agent/python"
    told = config(tmp_path, preflight_python="/t/py", preflight_probe="/t/fake.py")
    assert probe_command(spec(), told, "/agent/python") == ("/t/py", "/t/fake.py")
    plan = default_plan(told, "/agent/python")(spec(), {"GPU-a": 0})
    assert plan.preflight is not None and plan.preflight.process.argv == ("/t/py", "/t/fake.py")


def test_deployment_setting_and_its_default() -> None:
    base = {"name": "x", "model": "m", "engine": "vllm", "gpus_per_node": 1, "replicas": 1}
    assert parse_deployment({**base, "nodes": 2}, "t").preflight_mode == "required"
    assert parse_deployment({**base, "nodes": 2, "preflight": "off"}, "t").preflight_mode == ""
    # A bare `off` in YAML is false, `on` true.
    assert parse_deployment({**base, "nodes": 2, "preflight": False}, "t").preflight == "off"
    assert parse_deployment({**base, "nodes": 2, "preflight": True}, "t").preflight == "required"
    assert parse_deployment({**base, "preflight": "required"}, "t").preflight_mode == ""  # one node
    sim = {**base, "engine": "simulated", "nodes": 2}
    assert parse_deployment(sim, "t").preflight_mode == ""
    assert parse_deployment({**sim, "preflight": "best_effort"}, "t").preflight_mode == "best_effort"
    d = parse_deployment({**base, "nodes": 2, "preflight_timeout": "20s", "preflight_min_busbw": 40}, "t")
    assert parse_deployment(d.plain(), "t") == d
    assert "preflight" not in parse_deployment(base, "t").plain()
    for bad in ({"preflight": "yes"}, {"preflight_timeout": "0s"}, {"preflight_min_busbw": -1},
                {"preflight_min_busbw": True}):
        with pytest.raises(Exception, match=next(iter(bad))):
            parse_deployment({**base, **bad}, "t")


FAKE = """import json, os, sys, time
mode = {mode!r}
cfg = json.loads(os.environ["LLMGW_PREFLIGHT"])
if mode == "hang":
    time.sleep(60)
doc = {{"ok": mode != "fail", "backend": "gloo", "world": 2, "seconds": 0.1, "error": "boom",
       "results": [{{"bytes": 4194304, "seconds": 0.01, "algbw_gbps": 0.4, "busbw_gbps": 0.4}}]}}
print("LLMGW_PREFLIGHT " + json.dumps(doc), flush=True)
sys.exit(3 if mode == "exit" else 0)
"""


def fake_probe(tmp_path: Path, mode: str) -> list[str]:
    path = tmp_path / f"probe_{mode}.py"
    path.write_text(FAKE.format(mode=mode))
    return [sys.executable, str(path)]


def doc(tmp_path: Path, mode: str, **kw: object) -> dict[str, object]:
    return {"name": "preflight", "argv": fake_probe(tmp_path, mode),
            "env": {PROBE_ENV: "{}", "PATH": "/usr/bin:/bin"}, "cwd": str(tmp_path),
            "timeout": 30.0, "required": True, "min_busbw_gbps": 0.0,
            "result": str(tmp_path / "preflight.json"), **kw}


@pytest.mark.parametrize("mode, kw, why", [
    ("pass", {}, ""),
    ("pass", {"min_busbw_gbps": 10.0}, "bus bandwidth 0.4 GB/s is below 10 GB/s"),
    ("fail", {}, "boom"),
    ("exit", {}, "the probe exited 3"),
    ("hang", {"timeout": 0.5}, "timed out after 0.5s"),
])
def test_the_runner_judges_and_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       mode: str, kw: dict[str, object], why: str) -> None:
    monkeypatch.setattr(preflight_run, "GRACE", 0.5)
    r = preflight_run.probe(doc(tmp_path, mode, **kw))
    assert r.ok == (not why) and r.error.startswith(why)
    assert preflight_run.run(doc(tmp_path, mode, **kw)) == (not why)
    saved = json.loads((tmp_path / "preflight.json").read_text())
    assert saved["ok"] == (not why) and saved["line"] == r.line()
    assert preflight_run.run(doc(tmp_path, mode, required=False, **kw))  # best effort: starts


def test_the_launcher_starts_the_engine_only_after_a_pass(tmp_path: Path) -> None:
    for mode, rc in (("pass", 0), ("fail", 3)):
        s = spec()
        assert s.gang is not None
        s = attrs.evolve(s, gang=attrs.evolve(s.gang, preflight_min_busbw=0.0))
        plan = build_plan(attrs.evolve(s, engine=EngineKind.SIMULATED), config(tmp_path), str(tmp_path),
                          python=sys.executable, gpu_indices={"GPU-a": 0},
                          probe=tuple(fake_probe(tmp_path, mode)))  # type: ignore[arg-type]
        main = attrs.evolve(plan.main, argv=(sys.executable, "-c", "print('engine ran')"))
        plan = attrs.evolve(plan, processes=(main,))
        folder = tmp_path / "engines" / "r1"
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / f"engine-{mode}.log"
        pid = spawn_plan(plan, str(folder), str(log), "r1")
        _, status = os.waitpid(pid, 0)
        text = log.read_text()
        assert os.waitstatus_to_exitcode(status) == rc, text
        assert ("engine ran" in text) == (mode == "pass")
        assert "llmgw launcher: pre-flight " + ("passed" if mode == "pass" else "failed: boom") in text


def test_the_default_floor_follows_the_fabrics_rate_on_gpus_only(tmp_path: Path) -> None:
    from llmgw.agent.engines.preflight import floor_for, nccl_floor
    from llmgw.config.agent import FabricConfig
    from llmgw.model.affinity import GpuHca

    assert nccl_floor(400, 2) == 50.0  # half of two 400 Gb/s HCAs' 100 GB/s
    assert nccl_floor(0, 2) == 0.0 and nccl_floor(400, 0) == 0.0
    cfg = attrs.evolve(config(tmp_path), fabrics=(FabricConfig("ib", ("mlx5_0", "mlx5_1"), 400),))
    s = spec()
    assert s.gang is not None
    s = attrs.evolve(s, gang=attrs.evolve(s.gang, hcas=("mlx5_0", "mlx5_1"), preflight_min_busbw=0.0))
    one = (GpuHca("GPU-a", 3, "mlx5_1"),)
    pre = build_plan(s, cfg, "/w", gpu_indices={"GPU-a": 3}, probe=("py", "p"), nics=one).preflight
    assert pre is not None and pre.nccl_floor_gbps == 25.0  # the one HCA its GPU rides
    pre = build_plan(s, cfg, "/w", gpu_indices={"GPU-a": 3}, probe=("py", "p")).preflight
    assert pre is not None and pre.nccl_floor_gbps == 50.0  # no map: the fabric's HCAs here
    nccl, gloo = ProbeResult(True, backend="nccl"), ProbeResult(True, backend="gloo")
    assert floor_for(nccl, 0.0, 25.0) == 25.0 and floor_for(gloo, 0.0, 25.0) == 0.0
    assert floor_for(gloo, 5.0, 25.0) == 5.0  # the deployment's floor holds everywhere


def test_the_runner_applies_the_default_floor_to_nccl(tmp_path: Path) -> None:
    nccl = tmp_path / "nccl.py"
    nccl.write_text(FAKE.format(mode="pass").replace('"backend": "gloo"', '"backend": "nccl"'))
    d = {**doc(tmp_path, "pass"), "argv": [sys.executable, str(nccl)], "nccl_floor_gbps": 25.0}
    r = preflight_run.probe(d)
    assert not r.ok and r.error == "bus bandwidth 0.4 GB/s is below 25 GB/s"
    assert preflight_run.probe(doc(tmp_path, "pass", nccl_floor_gbps=25.0)).ok  # gloo: no floor

"""Engines a node can run (issue 10, item 5): a node whose vllm does not resolve is not
given vllm replicas, says why, and takes them as soon as the binary appears; an agent
asked anyway refuses with the config key named, without a traceback."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from attrs import evolve

from fakes.engines import free_port
from fakes.live import Cluster, wait_for
from fakes.supervision import Reports
from fakes.supervisor_proc import config
from llmgw.agent.lifecycle.supervisor import Supervisor
from llmgw.config.agent import EnginesConfig, VllmConfig
from llmgw.model.engine import EngineKind, EngineSpec, EngineState

FAST = {"LLMGW_SIM_TTFT": "0.01", "LLMGW_SIM_TOKENS_PER_SECOND": "1000"}


def fake_vllm(path: Path) -> None:
    """An executable `vllm` that is the simulated engine (it takes vLLM's command line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nexec {sys.executable} -m llmgw.simengine "$@"\n')
    path.chmod(0o755)


async def test_missing_binary_refused_naming_the_key_without_traceback(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = tmp_path / "bin" / "vllm"
    base = config(str(tmp_path / "work"))
    cfg = evolve(base, engines=EnginesConfig(vllm=VllmConfig(bin=str(missing))))
    asked: list[bool] = []
    reports = Reports()
    sup = Supervisor(cfg, reports, on_unavailable=lambda: asked.append(True))
    s = EngineSpec("v-0", 1, "dep", "org/m", "m", EngineKind.VLLM, (), free_port(),
                   env=dict(FAST), startup_timeout=30)
    with caplog.at_level(logging.INFO):
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.serve)
            await sup.apply((s,))
            r = await reports.wait("v-0", EngineState.EXITED, timeout=5)
            assert r.reason == f"could not start: engines.vllm.bin: {missing} not found"
            assert asked == [True]
            await sup.apply((s,))  # the same generation again: no second attempt
            assert len(reports.seen) == 1
            # The binary appears; the server's next generation starts it.
            fake_vllm(missing)
            await sup.apply((evolve(s, generation=2),))
            await reports.wait("v-0", EngineState.READY, timeout=15)
            await sup.apply(())
            nursery.cancel_scope.cancel()
    assert not any(rec.exc_info for rec in caplog.records)


@pytest.mark.slow
def test_vllm_deployment_pending_until_the_binary_appears(tmp_path: Path) -> None:
    c = Cluster(tmp_path / "c")
    vllm = tmp_path / "opt" / "bin" / "vllm"
    try:
        c.start_server()
        agent = c.start_agent("n1", discovery={"simulated_gpus": 2},
                              engines={"vllm": {"bin": str(vllm), "launch_mode": "mp"}})
        c.wait_states({"n1": "ready"})
        f = tmp_path / "v.yaml"
        f.write_text("name: v\nmodel: org/v\nengine: vllm\ngpus_per_node: 1\nreplicas: 1\n"
                     "env:\n  LLMGW_SIM_TTFT: '0.01'\n")
        r = c.ctl("apply", "-f", str(f))
        assert r.returncode == 0, r.stderr
        want = f"1 lacked engine vllm (engines.vllm.bin: {vllm} not found)"

        def describe() -> dict[str, Any]:
            out = c.ctl("describe", "deployment", "v", "-o", "json")
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)

        wait_for(lambda: want in json.dumps(describe()), 20, "the pending reason", interval=0.5)
        statuses = {d["name"]: d["status"] for d in c.status()["deployments"]}
        assert want in statuses["v"], statuses

        fake_vllm(vllm)
        r = c.ctl("rediscover")
        assert r.returncode == 0, r.stderr

        def ready() -> bool:
            out = c.ctl("get", "replicas", "-o", "json")
            return any(x["deployment"] == "v" and x["state"] == "ready"
                       for x in json.loads(out.stdout))

        wait_for(ready, 30, "the vllm replica ready once the binary exists", interval=0.5)
        text = agent.text()
        assert "Traceback" not in text
        assert "could not start" not in text  # never asked to start it while it lacked vllm
    finally:
        c.close()

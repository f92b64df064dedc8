"""More adapters than LoRA slots, end to end with the simulated engine (issue 23): the
deployment is accepted, every adapter is served by name, and `describe deployment` and the
apply's event say how they share the slots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fakes.adapters import write_adapter
from fakes.live import Cluster, wait_for
from fakes.nvidia_smi import pcie_box
from fakes.web import http_json


def _complete(router: str, model: str) -> tuple[int, Any]:
    return http_json(f"{router}/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2})


def test_three_adapters_on_two_slots_are_served_and_explained(cluster: Cluster, tmp_path: Path) -> None:
    names = ["base-a", "base-b", "base-c"]
    cluster.up({"n1": {"discovery": {"nvidia_smi": str(pcie_box(tmp_path / "smi"))}}})
    p, port = cluster.start_router(extra='table_poll_interval = "200ms"\n')
    p.wait_line("router listening", 20, "router start")
    router = f"http://127.0.0.1:{port}"
    lines = ["name: lora", "model: org/sim-base", "served_name: base", "engine: simulated",
             "gpus_per_node: 1", "replicas: 1", "max_loras: 2", "adapters:"]
    lines += [f"  - {{name: {n}, path: {write_adapter(tmp_path / 'adapters' / n)}}}" for n in names]
    cluster.apply("lora", "\n".join(lines) + "\n")
    for n in names:
        wait_for(lambda n=n: _complete(router, n)[0] == 200, 60, f"{n} served", interval=0.3)
    described = cluster.ctl("describe", "deployment", "lora").stdout
    want = "3 adapters share 2 LoRA slots per engine (max_loras 2): at most 2 of them in one batch"
    assert f"LoRA:      {want}" in described, described
    assert f"created ({want}" in described  # the apply's event

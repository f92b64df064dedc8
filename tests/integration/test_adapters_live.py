"""LoRA adapters end to end, with real server, agent and router processes on 127.0.0.1
and the simulated engine: an adapter added to a deployment is loaded on the running
engine without a restart (the pid stays) and routed by name through the router, listed in
/v1/models with its base; removed, it is unloaded, and then a 404 like an unknown model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fakes.adapters import write_adapter
from fakes.live import Cluster, engine_pids, wait_for
from fakes.nvidia_smi import pcie_box
from fakes.web import http_json


def _router(cluster: Cluster) -> str:
    p, port = cluster.start_router(extra='table_poll_interval = "200ms"\n')
    p.wait_line("router listening", 20, "router start")
    return f"http://127.0.0.1:{port}"


def _apply(cluster: Cluster, adapters: list[tuple[str, Path]]) -> None:
    lines = ["name: lora", "model: org/sim-base", "served_name: base", "engine: simulated",
             "gpus_per_node: 1", "replicas: 1", "max_loras: 2"]
    if adapters:
        lines.append("adapters:")
        lines += [f"  - {{name: {n}, path: {p}}}" for n, p in adapters]
    cluster.apply("lora", "\n".join(lines) + "\n")


def _models(router: str) -> dict[str, dict]:
    status, doc = http_json(f"{router}/v1/models")
    assert status == 200
    return {c["id"]: c for c in doc["data"]}


def _complete(router: str, model: str) -> tuple[int, Any]:
    return http_json(f"{router}/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2})


def test_adapters_load_route_and_unload_without_a_restart(cluster: Cluster, tmp_path: Path) -> None:
    sql = write_adapter(tmp_path / "adapters" / "sql")
    chat = write_adapter(tmp_path / "adapters" / "chat")
    cluster.up({"n1": {"discovery": {"nvidia_smi": str(pcie_box(tmp_path / "smi"))}}})
    router = _router(cluster)

    _apply(cluster, [("base-sql", sql)])
    wait_for(lambda: _complete(router, "base-sql")[0] == 200, 60, "base-sql served", interval=0.3)
    status, answer = _complete(router, "base-sql")
    assert answer["model"] == "base-sql"  # the engine answers in the adapter's name
    pids = set(engine_pids(cluster.root))
    assert len(pids) == 1

    # Added: loaded on the running engine, routed by name, listed with its base.
    _apply(cluster, [("base-sql", sql), ("base-chat", chat)])
    wait_for(lambda: _complete(router, "base-chat")[0] == 200, 30, "base-chat served", interval=0.3)
    cards = _models(router)
    assert cards["base-chat"]["parent"] == "base" and cards["base-sql"]["parent"] == "base"
    assert "parent" not in cards["base"]
    assert set(engine_pids(cluster.root)) == pids  # no restart

    # Removed: unloaded, then unknown, as a model that is not deployed is.
    _apply(cluster, [("base-chat", chat)])
    # Between the engine's unload and the router's next table the engine itself answers
    # 404 (vLLM's "The model `base-sql` does not exist."); then the router does.
    def gone() -> bool:
        status, answer = _complete(router, "base-sql")
        return status == 404 and answer["error"]["code"] == "model_not_found"

    wait_for(gone, 30, "base-sql unknown to the router", interval=0.3)
    assert _complete(router, "base-chat")[0] == 200 and _complete(router, "base")[0] == 200
    assert "base-sql" not in _models(router)
    assert set(engine_pids(cluster.root)) == pids

    # A path no node sees: the router answers 503 with the engine's reason, not 404.
    _apply(cluster, [("base-chat", chat), ("base-lost", tmp_path / "nowhere")])

    def lost() -> tuple[int, Any] | None:
        got = _complete(router, "base-lost")
        return got if got[0] == 503 and "No adapter found" in json.dumps(got[1]) else None

    wait_for(lost, 30, "base-lost refused with its reason", interval=0.3)
    events = cluster.ctl("describe", "replica", "lora-0")
    assert "no restart" in events.stdout, events.stdout
    # describe says which are loaded where, and why one is not.
    assert "Adapters:   base-chat (on n1)" in events.stdout, events.stdout
    assert (f"  not loaded: base-lost: Loading lora base-lost failed: No adapter found for "
            f"{tmp_path / 'nowhere'} (HTTP 404)") in events.stdout, events.stdout
    assert set(engine_pids(cluster.root)) == pids
    # Bad input stays one line, exit 2, naming the field.
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nmodel: org/m\nengine: simulated\ngpus_per_node: 1\nreplicas: 1\n"
                   "adapters:\n  - {name: x, path: /a}\n  - {name: x, path: /b}\n")
    r = cluster.ctl("apply", "-f", str(bad))
    assert r.returncode == 2 and "adapters[1].name: 'x' names two adapters" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    other = tmp_path / "other.yaml"
    other.write_text("name: other\nmodel: org/o\nserved_name: base-chat\nengine: simulated\n"
                     "gpus_per_node: 1\nreplicas: 0\n")
    r = cluster.ctl("apply", "-f", str(other))
    assert r.returncode != 0 and "is an adapter of deployment 'lora'" in r.stderr, r.stderr

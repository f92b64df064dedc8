"""vLLM's CPU build serves LoRA adapters by name through the router (issue 23): a LoRA
adapter for the tests' tiny Llama made here (adapter_config.json and
adapter_model.safetensors written directly: no peft, no download), loaded by the agent on
the running engine over vLLM's /v1/load_lora_adapter; a second one added to the
deployment is loaded without the engine's pid changing; the first removed is unloaded,
and then the router's 404.

One engine start; every process started here is killed by pid at the end.
"""

from __future__ import annotations

import random
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from fakes.adapters import write_adapter
from fakes.engine_keys import auth, engine_key
from fakes.live import Cluster, wait_for
from fakes.nvidia_smi import pcie_box
from fakes.vllm_rig import READY_TIMEOUT, engine_log, leaders, node_copy, tiny_yaml, vllm_agent
from fakes.web import http_json

pytestmark = pytest.mark.real_engine

# The tiny Llama of make_model.py --shape cpu: hidden 128, 4 heads (and KV heads) of 32.
HIDDEN, LAYERS, RANK = 128, 2, 8


def _adapter(folder: Path, seed: int) -> Path:
    """A rank-8 LoRA on q_proj and v_proj of both layers, small random weights, float32."""
    rng = random.Random(seed)

    def tensor(rows: int, cols: int) -> tuple[tuple[int, ...], bytes]:
        return (rows, cols), struct.pack(f"<{rows * cols}f", *(rng.uniform(-0.01, 0.01)
                                                               for _ in range(rows * cols)))

    tensors = {}
    for layer in range(LAYERS):
        for proj in ("q_proj", "v_proj"):
            base = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{base}.lora_A.weight"] = tensor(RANK, HIDDEN)
            tensors[f"{base}.lora_B.weight"] = tensor(HIDDEN, RANK)
    return write_adapter(folder, rank=RANK, base="org/tiny", tensors=tensors)


def _router(cluster: Cluster) -> str:
    p, port = cluster.start_router(
        extra='table_poll_interval = "200ms"\nfirst_byte_timeout = "120s"\n')
    p.wait_line("router listening", 20, "router start")
    return f"http://127.0.0.1:{port}"


def _http(url: str, body: Any = None) -> tuple[int, Any]:
    return http_json(url, body, timeout=120)


def _complete(router: str, model: str) -> tuple[int, Any]:
    return _http(f"{router}/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 4})


def _apply(cluster: Cluster, adapters: list[tuple[str, Path]]) -> None:
    cluster.apply("tiny", tiny_yaml(extra="max_loras: 2\nadapters:\n" + "".join(
        f"  - {{name: {n}, path: {p}}}\n" for n, p in adapters)))


def test_vllm_serves_adapters_by_name_through_the_router(
        cluster: Cluster, vllm_venv: Path, tiny_model: Path, tmp_path: Path) -> None:
    models = node_copy(tiny_model, tmp_path)
    sql = _adapter(tmp_path / "adapters" / "sql", 1)
    chat = _adapter(tmp_path / "adapters" / "chat", 2)
    cluster.up({"cpu-1": vllm_agent(vllm_venv, pcie_box(tmp_path / "smi"), models)})
    router = _router(cluster)
    log = engine_log(tmp_path)
    t0 = time.monotonic()
    _apply(cluster, [("tiny-sql", sql)])
    wait_for(lambda: _complete(router, "tiny-sql")[0] == 200, READY_TIMEOUT,
             f"tiny-sql served through the router (log: {log})", interval=1.0)
    print(f"vLLM ready with its adapter in {time.monotonic() - t0:.0f}s")
    status, answer = _complete(router, "tiny-sql")
    assert answer["model"] == "tiny-sql", answer  # vLLM answers in the adapter's name
    text = log.read_text(errors="replace")
    assert "Loaded new LoRA adapter: name 'tiny-sql'" in text
    (leader,) = leaders(tmp_path)

    t1 = time.monotonic()
    _apply(cluster, [("tiny-sql", sql), ("tiny-chat", chat)])
    wait_for(lambda: _complete(router, "tiny-chat")[0] == 200, 120, "tiny-chat served", interval=0.5)
    print(f"second adapter served {time.monotonic() - t1:.1f}s after the apply")
    status, doc = _http(f"{router}/v1/models")
    cards = {c["id"]: c for c in doc["data"]}
    assert cards["tiny-chat"]["parent"] == "org/tiny" and cards["tiny-sql"]["parent"] == "org/tiny"
    # vLLM's own list says the same: the adapters with their paths, under the base.
    port = _engine_port(leader)
    engine = http_json(f"http://127.0.0.1:{port}/v1/models", headers=auth(engine_key(port)))[1]
    roots = {c["id"]: (c.get("parent"), c.get("root")) for c in engine["data"]}
    assert roots["tiny-chat"] == ("org/tiny", str(chat)) and roots["tiny-sql"][1] == str(sql)

    _apply(cluster, [("tiny-chat", chat)])

    def gone() -> bool:
        status, answer = _complete(router, "tiny-sql")
        return status == 404 and answer["error"]["code"] == "model_not_found"

    wait_for(gone, 120, "tiny-sql unknown to the router", interval=0.5)
    assert "Removed LoRA adapter: name 'tiny-sql'" in log.read_text(errors="replace")
    assert _complete(router, "tiny-chat")[0] == 200 and _complete(router, "org/tiny")[0] == 200
    assert leaders(tmp_path) == [leader]


def _engine_port(leader: int) -> int:
    argv = Path(f"/proc/{leader}/cmdline").read_bytes().split(b"\0")
    return int(argv[argv.index(b"--port") + 1])


def test_more_adapters_than_slots_are_all_served(
        cluster: Cluster, vllm_venv: Path, tiny_model: Path, tmp_path: Path) -> None:
    """Three adapters on one slot (max_loras: 1): vLLM serves each in turn, all kept in
    host memory (--max-cpu-loras 3, which vLLM's LoRAConfig takes), and `describe
    deployment` says how they share the slot."""
    models = node_copy(tiny_model, tmp_path)
    names = [f"tiny-a{i}" for i in range(3)]
    paths = [_adapter(tmp_path / "adapters" / n, i) for i, n in enumerate(names)]
    cluster.up({"cpu-1": vllm_agent(vllm_venv, pcie_box(tmp_path / "smi"), models)})
    router = _router(cluster)
    log = engine_log(tmp_path)
    cluster.apply("tiny", tiny_yaml(extra="max_loras: 1\nadapters:\n" + "".join(
        f"  - {{name: {n}, path: {p}}}\n" for n, p in zip(names, paths, strict=True))))
    for n in names:
        wait_for(lambda n=n: _complete(router, n)[0] == 200, READY_TIMEOUT,
                 f"{n} served through the router (log: {log})", interval=1.0)
    for n in [*names, *reversed(names)]:  # each again, after the others had the slot
        status, answer = _complete(router, n)
        assert status == 200 and answer["model"] == n, answer
    (leader,) = leaders(tmp_path)
    argv = Path(f"/proc/{leader}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"--max-loras") + 1] == b"1"
    assert argv[argv.index(b"--max-cpu-loras") + 1] == b"3"
    described = cluster.ctl("describe", "deployment", "tiny").stdout
    assert "LoRA:      3 adapters share 1 LoRA slot per engine (max_loras 1)" in described, described

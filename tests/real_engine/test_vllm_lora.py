"""vLLM's CPU build serves LoRA adapters by name through the router (issue 23): a LoRA
adapter for the tests' tiny Llama made here (adapter_config.json and
adapter_model.safetensors written directly: no peft, no download), loaded by the agent on
the running engine over vLLM's /v1/load_lora_adapter; a second one added to the
deployment is loaded without the engine's pid changing; the first removed is unloaded,
and then the router's 404.

One engine start; every process started here is killed by pid at the end.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fakes.adapters import write_adapter
from fakes.engines import free_port
from fakes.live import LLMGW, Cluster, Proc, engine_pids, wait_for
from fakes.nvidia_smi import pcie_box
from llmgw.agent import procs
from llmgw.transport import keys

pytestmark = pytest.mark.real_engine

READY_TIMEOUT = 420  # model load on 2 busy cores: 25-130 s seen (--enforce-eager)
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
ENGINE_ARGS = ["--max-model-len", "512", "--enforce-eager"]
# The tiny Llama of make_model.py --shape cpu: hidden 128, 4 heads (and KV heads) of 32.
HIDDEN, LAYERS, RANK = 128, 2, 8


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, heartbeat="1s", lost_after="60s")
    try:
        yield c
    finally:
        c.close()


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


def _router(cluster: Cluster, tmp_path: Path) -> str:
    keys.issue_key(str(cluster.keys_dir), "router", "r1")
    port = free_port()
    cfg = tmp_path / "router.toml"
    cfg.write_text(f'bind = "127.0.0.1:{port}"\nserver = "{cluster.address}"\n'
                   'table_poll_interval = "200ms"\nfirst_byte_timeout = "120s"\n[keys]\n'
                   f'secret_key = "{cluster.keys_dir / "r1.key_secret"}"\n'
                   f'server_key = "{cluster.server_key}"\n')
    p = Proc([*LLMGW, "router", "--config", str(cfg)], tmp_path / "router.log")
    cluster.procs.append(p)
    wait_for(lambda: "router listening" in p.text() or p.p.poll() is not None, 20, "router start")
    assert p.p.poll() is None, p.text()
    return f"http://127.0.0.1:{port}"


def _http(url: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def _complete(router: str, model: str) -> tuple[int, Any]:
    return _http(f"{router}/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 4})


def _apply(cluster: Cluster, tmp_path: Path, adapters: list[tuple[str, Path]]) -> None:
    dep = tmp_path / "tiny.yaml"
    dep.write_text(
        "name: tiny\nmodel: org/tiny\nengine: vllm\ngpus_per_node: 1\nreplicas: 1\n"
        f"startup_timeout: {READY_TIMEOUT}s\nargs: {json.dumps(ENGINE_ARGS)}\n"
        f"env: {json.dumps(ENGINE_ENV)}\nmax_loras: 2\n"
        "adapters:\n" + "".join(f"  - {{name: {n}, path: {p}}}\n" for n, p in adapters))
    r = cluster.ctl("apply", "-f", str(dep))
    assert r.returncode == 0, r.stderr


def test_vllm_serves_adapters_by_name_through_the_router(
        cluster: Cluster, vllm_venv: Path, tiny_model: Path, tmp_path: Path) -> None:
    models = tmp_path / "models"
    shutil.copytree(tiny_model, models / "org" / "tiny")
    sql = _adapter(tmp_path / "adapters" / "sql", 1)
    chat = _adapter(tmp_path / "adapters" / "chat", 2)
    cluster.start_server()
    cluster.start_agent(
        "cpu-1",
        discovery={"nvidia_smi": str(pcie_box(tmp_path / "smi"))},
        engines={"vllm": {"bin": str(vllm_venv / "bin" / "vllm"), "launch_mode": "mp"}},
        model_dirs=[str(models)])
    cluster.wait_states({"cpu-1": "ready"})
    router = _router(cluster, tmp_path)
    log = tmp_path / "agents" / "cpu-1" / "work" / "engines" / "tiny-0" / "engine.log"
    t0 = time.monotonic()
    _apply(cluster, tmp_path, [("tiny-sql", sql)])
    wait_for(lambda: _complete(router, "tiny-sql")[0] == 200, READY_TIMEOUT,
             f"tiny-sql served through the router (log: {log})", interval=1.0)
    print(f"vLLM ready with its adapter in {time.monotonic() - t0:.0f}s")
    status, answer = _complete(router, "tiny-sql")
    assert answer["model"] == "tiny-sql", answer  # vLLM answers in the adapter's name
    text = log.read_text(errors="replace")
    assert "Loaded new LoRA adapter: name 'tiny-sql'" in text
    (leader,) = [p for p in engine_pids(tmp_path) if procs.session_of(p) == p]

    t1 = time.monotonic()
    _apply(cluster, tmp_path, [("tiny-sql", sql), ("tiny-chat", chat)])
    wait_for(lambda: _complete(router, "tiny-chat")[0] == 200, 120, "tiny-chat served", interval=0.5)
    print(f"second adapter served {time.monotonic() - t1:.1f}s after the apply")
    status, doc = _http(f"{router}/v1/models")
    cards = {c["id"]: c for c in doc["data"]}
    assert cards["tiny-chat"]["parent"] == "org/tiny" and cards["tiny-sql"]["parent"] == "org/tiny"
    # vLLM's own list says the same: the adapters with their paths, under the base.
    engine = _http(f"http://127.0.0.1:{_engine_port(leader)}/v1/models")[1]
    roots = {c["id"]: (c.get("parent"), c.get("root")) for c in engine["data"]}
    assert roots["tiny-chat"] == ("org/tiny", str(chat)) and roots["tiny-sql"][1] == str(sql)

    _apply(cluster, tmp_path, [("tiny-chat", chat)])

    def gone() -> bool:
        status, answer = _complete(router, "tiny-sql")
        return status == 404 and answer["error"]["code"] == "model_not_found"

    wait_for(gone, 120, "tiny-sql unknown to the router", interval=0.5)
    assert "Removed LoRA adapter: name 'tiny-sql'" in log.read_text(errors="replace")
    assert _complete(router, "tiny-chat")[0] == 200 and _complete(router, "org/tiny")[0] == 200
    assert [p for p in engine_pids(tmp_path) if procs.session_of(p) == p] == [leader]


def _engine_port(leader: int) -> int:
    argv = Path(f"/proc/{leader}/cmdline").read_bytes().split(b"\0")
    return int(argv[argv.index(b"--port") + 1])

"""Routing by the KV cache, end to end on a real vLLM (CPU build, the tiny Llama): llmgw's
server, an agent with a KV relay and a `kv_aware` router, one `kv_events` replica whose
engine cache is small (160 blocks of 32 tokens). Through the router's own /metrics:

- what the engine stores reaches the router's index, and a request that shares a cached
  prefix is predicted to hit exactly what vLLM itself then counts as prefix-cache hits
  (vllm:prefix_cache_hits, in tokens: blocks x 32);
- prompts beyond the cache make vLLM evict: BlockRemoved reaches the index, which never
  holds more blocks than the engine has;
- the engine SIGKILLed and restarted by the agent: a new life of its events clears the
  router's index for it (llmgw_router_kv_clears_total{why="life"}), which fills again.

One engine start and one restart; every process is killed by pid at the end.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fakes.engine_keys import auth, url_key
from fakes.engines import free_port
from fakes.live import Cluster, wait_for
from fakes.nvidia_smi import pcie_box
from fakes.vllm_rig import DTYPE, ENGINE_ENV, READY_TIMEOUT, leaders, vllm_agent
from fakes.web import series

pytestmark = pytest.mark.real_engine

BLOCK = 32
BLOCKS = 160  # 5,120 tokens: a few of the prompts below fill it
ARGS = ["--max-model-len", "4096", "--enforce-eager", *DTYPE, "--block-size", str(BLOCK),
        "--num-gpu-blocks-override", str(BLOCKS)]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"{rng.choice(('alpha', 'river', 'stone', 'paper', 'cloud'))}{rng.randrange(100)}"
                    for _ in range(n))


def _get(url: str, headers: dict[str, str] | None = None) -> str:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read().decode()  # type: ignore[no-any-return]


def _complete(base: str, prompt: str) -> dict[str, Any]:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


class Kv:
    def __init__(self, root: Path, venv: Path, model: Path) -> None:
        self.c = Cluster(root, heartbeat="1s", lost_after="60s")
        self.c.start_server()
        self.c.start_agent("cpu-1", **vllm_agent(venv, pcie_box(root / "smi")),
                           kv_relay_port=free_port())
        self.c.wait_states({"cpu-1": "ready"}, timeout=60)
        self.c.apply("tiny", (f"name: tiny\nmodel: {model}\nengine: vllm\ngpus_per_node: 1\n"
                              f"replicas: 1\nserved_name: tiny\nkv_events: true\n"
                              f"startup_timeout: {READY_TIMEOUT}s\nargs: {json.dumps(ARGS)}\n"
                              f"env: {json.dumps(ENGINE_ENV)}\n"))
        self.root = root
        self.gen = self.wait_ready(0)
        _, port = self.c.start_router("edge", extra=(
            'metrics_interval = "250ms"\nmetrics_stale_after = "5s"\n'
            f'[models.tiny]\npolicy = "kv_aware"\ntokenizer = "{model}"\n'))
        self.base = f"http://127.0.0.1:{port}"
        wait_for(lambda: '"tiny"' in self._models(), 30, "router lists the model")

    def _models(self) -> str:
        try:
            return _get(self.base + "/v1/models")
        except OSError:
            return ""

    def wait_ready(self, newer_than: int) -> int:
        def ready() -> int | None:
            rep = next(iter(self.c.replicas().values()), {})
            ok = rep.get("state") == "ready" and rep["generation"] > newer_than
            return int(rep["generation"]) if ok else None
        return int(wait_for(ready, READY_TIMEOUT, "vLLM replica ready", interval=1.0))

    def metrics(self) -> str:
        return _get(self.base + "/metrics")

    def engine(self) -> tuple[str, str]:
        url = str(next(iter(self.c.replicas().values()))["endpoint"])
        return url, url_key(url)

    def engine_hits(self) -> float:
        url, key = self.engine()
        return series(_get(url + "/metrics", auth(key)), "vllm:prefix_cache_hits_total")

    def close(self) -> None:
        self.c.close()


@pytest.fixture(scope="module")
def kv(vllm_venv: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kv]:
    k = Kv(tmp_path_factory.mktemp("kv-live"), vllm_venv, tiny_model)
    try:
        yield k
    finally:
        k.close()


def _m(text: str, name: str, **labels: str) -> float:
    """One series of the router's metrics, summed over what `labels` leaves open."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_stored_blocks_reach_the_index_and_predict_vllms_own_hits(kv: Kv) -> None:
    rng = random.Random(3)
    doc = "Document one.\n" + _words(rng, 250)  # about 40 blocks
    _complete(kv.base, f"{doc}\nQuestion 0: {_words(rng, 6)}?")
    # The engine's BlockStored batches come through the agent's relay to the router.
    wait_for(lambda: _m(kv.metrics(), "llmgw_router_kv_index_blocks", model="tiny") > 20, 30,
             "the router's index holds the document's blocks")
    m0 = kv.metrics()
    assert _m(m0, "llmgw_router_kv_blocks_total", kind="stored") > 20
    assert _m(m0, "llmgw_router_kv_fallbacks_total") <= 1  # at most the very first request
    hits0 = kv.engine_hits()
    time.sleep(2.5)  # past kv_speculative_ttl: only the engine's own events count
    _complete(kv.base, f"{doc}\nQuestion 1: {_words(rng, 6)}?")
    m1 = kv.metrics()
    predicted = (_m(m1, "llmgw_router_kv_predicted_hit_blocks_total")
                 - _m(m0, "llmgw_router_kv_predicted_hit_blocks_total"))
    hits = kv.engine_hits() - hits0
    assert predicted > 20
    assert hits == predicted * BLOCK, (hits, predicted)  # what vLLM itself found cached


def test_evicted_blocks_leave_the_index(kv: Kv) -> None:
    rng = random.Random(4)
    for i in range(8):  # about 320 blocks of distinct prompts through a 160-block cache
        _complete(kv.base, f"Other {i}.\n" + _words(rng, 250))
    wait_for(lambda: _m(kv.metrics(), "llmgw_router_kv_blocks_total", kind="removed") > 0, 30,
             "BlockRemoved reached the router")
    time.sleep(1.0)  # the last batches applied
    m = kv.metrics()
    assert 0 < _m(m, "llmgw_router_kv_index_blocks", model="tiny") <= BLOCKS
    assert _m(m, "llmgw_router_kv_blocks_total", kind="orphan") == 0


def test_an_engine_restart_clears_the_index_and_it_fills_again(kv: Kv) -> None:
    m0 = kv.metrics()
    assert _m(m0, "llmgw_router_kv_index_blocks", model="tiny") > 0
    lives = _m(m0, "llmgw_router_kv_clears_total", why="life")
    [pid] = leaders(kv.root)
    os.kill(pid, signal.SIGKILL)
    kv.gen = kv.wait_ready(kv.gen)
    # The agent's new receiver and a new life of the replica's events: the router clears.
    wait_for(lambda: _m(kv.metrics(), "llmgw_router_kv_clears_total", why="life") > lives, 60,
             "the router cleared the restarted engine's blocks")
    assert _m(kv.metrics(), "llmgw_router_kv_index_blocks", model="tiny") == 0
    wait_for(lambda: '"tiny"' in kv._models(), 30, "router routes the model again")
    rng = random.Random(5)
    _complete(kv.base, "Again.\n" + _words(rng, 250))
    wait_for(lambda: _m(kv.metrics(), "llmgw_router_kv_index_blocks", model="tiny") > 20, 30,
             "the new engine's blocks in the index")

"""A real vLLM (CPU build, the tiny Llama) started with llmgw's own launch plan for a
kv_events deployment publishes its KV-cache events to the agent's receiver: its PUB
connects to the loopback port the receiver bound, and after a few requests sharing a
prefix the receiver has decoded BlockStored batches (vLLM's own, seq from 0, no clear)
into the index. One engine start; the engine is killed by its pid at the end."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import trio
import zmq

from fakes.engines import free_port
from fakes.vllm_rig import DTYPE, ENGINE_ENV, READY_TIMEOUT
from llmgw.agent.engines import build_plan
from llmgw.agent.kvevents.receiver import serve_kv_receiver
from llmgw.config.agent import AgentConfig, EnginesConfig, KeysConfig, VllmConfig
from llmgw.kvcache.events import Batch, Stored
from llmgw.kvcache.index import KvIndex
from llmgw.model.deployment import ENGINE_PORT_BLOCK, KV_EVENTS_PUB, KV_EVENTS_REPLAY
from llmgw.model.engine import EngineKind, EngineSpec

pytestmark = pytest.mark.real_engine


def _free_block(size: int) -> int:
    for base in range(61000, 65000, size):
        socks = []
        try:
            for port in range(base, base + size):
                s = socket.socket()
                socks.append(s)  # closed below, bound or not
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free port block")


class Recorder:
    def __init__(self) -> None:
        self.index = KvIndex("tiny", 100_000)
        self.batches: list[Batch] = []
        self.clears = 0

    def apply(self, replica: str, batch: Batch) -> object:
        self.batches.append(batch)
        return self.index.apply(replica, batch)

    def clear(self, replica: str) -> None:
        self.clears += 1
        self.index.clear(replica)


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status)
    except OSError:
        return 0


def _complete(url: str, prompt: str) -> dict[str, Any]:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


async def test_vllm_publishes_to_the_agents_receiver(vllm_venv: Path, tiny_model: Path, tmp_path: Path) -> None:
    base, port = _free_block(ENGINE_PORT_BLOCK), free_port()
    spec = EngineSpec("tiny-0", 1, "tiny", str(tiny_model), "tiny", EngineKind.VLLM, (), port,
                      port_base=base, kv_events=True,
                      args=("--max-model-len", "2048", "--enforce-eager", *DTYPE))
    cfg = AgentConfig(node_id="n1", server="tcp://127.0.0.1:1", keys=KeysConfig("s", "p"),
                      mgmt_addr="127.0.0.1",
                      engines=EnginesConfig(vllm=VllmConfig(bin=str(vllm_venv / "bin" / "vllm"))))
    plan = build_plan(spec, cfg, str(tmp_path), gpu_indices={}).main
    assert "--kv-events-config" in plan.argv
    env = {**os.environ, **plan.env, **ENGINE_ENV}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    rec = Recorder()
    ctx: zmq.Context[Any] = zmq.Context()
    log = (tmp_path / "engine.log").open("wb")
    proc: trio.Process | None = None
    try:
        async with trio.open_nursery() as nursery:
            # Bound before the engine starts, as the agent would: its PUB connects to it.
            stream = await nursery.start(serve_kv_receiver, ctx, "tiny-0", base + KV_EVENTS_PUB,
                                         f"tcp://127.0.0.1:{base + KV_EVENTS_REPLAY}", rec)
            proc = await trio.lowlevel.open_process(list(plan.argv), env=env, cwd=tmp_path, stdout=log,
                                                    stderr=subprocess.STDOUT, start_new_session=True)
            url = f"http://127.0.0.1:{port}"
            with trio.fail_after(READY_TIMEOUT):
                while await trio.to_thread.run_sync(_get, url + "/health") != 200:
                    assert proc.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
                    await trio.sleep(1)
            prefix = " ".join(f"word{i}" for i in range(200))  # many blocks of shared prefix
            for tail in ("alpha", "beta", "gamma"):  # each long enough for blocks of its own
                own = " ".join(f"{tail}{i}" for i in range(100))
                await trio.to_thread.run_sync(_complete, url + "/v1/completions", f"{prefix} {own}")
            # Each request stores its own last blocks at least: three stores, by vLLM's
            # publisher thread, a moment after the answers.
            with trio.fail_after(60):
                while sum(isinstance(e, Stored) for b in rec.batches for e in b.events) < 3:
                    await trio.sleep(0.2)
            nursery.cancel_scope.cancel()
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            with trio.move_on_after(30):
                await proc.wait()
        log.close()
        ctx.destroy(linger=0)
    stored = [e for b in rec.batches for e in b.events if isinstance(e, Stored)]
    assert rec.clears == 0 and stream.stats.applied == len(rec.batches)
    assert [b.seq for b in rec.batches] == list(range(len(rec.batches)))  # vLLM's, from 0
    for e in stored:  # vLLM's CPU build: blocks of 128 tokens, token_ids spanning them all
        assert e.block_hashes and len(e.token_ids) == len(e.block_hashes) * e.block_size
    assert rec.index.size("tiny-0") > 0
    print(f"{len(rec.batches)} batches, {len(stored)} stores, {rec.index.size('tiny-0')} blocks indexed, "
          f"replays {stream.stats.replays}")

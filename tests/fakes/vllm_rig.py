"""What the real-engine tier's tests share: an agent that runs vLLM's CPU build from its
venv, the tiny Llama's deployment, a node's copy of it, where its engine logs and which
process is its engine's leader."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fakes.live import engine_pids
from llmgw.agent.process import procs

READY_TIMEOUT = 420  # model load on 2 busy cores: 25-130 s seen (--enforce-eager)
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
# --dtype float32 (the tiny model's own): vLLM 0.32's CPU build otherwise runs it in
# bfloat16, and on a CPU with AMX its attention kernel (cpu_attention_with_kv_cache) can die
# with SIGILL on an engine's first forward pass ("Fatal Python error: Illegal instruction";
# the API server then exits 0): seen here whenever the first request was a short plain
# completion, and in CI as a scale-from-zero engine that exited 5 s after ready. In
# float32 it never did (same requests, this machine).
DTYPE = ["--dtype", "float32"]
ENGINE_ARGS = ["--max-model-len", "512", "--enforce-eager", *DTYPE]


def vllm_agent(venv: Path, smi: Path, models: Path | None = None, **extra: Any) -> dict[str, Any]:
    """An agent's config overrides: GPUs from the nvidia-smi script `smi`, vLLM from
    `venv` (mp launch), `models` as its model_dirs when given, then `extra`."""
    kw: dict[str, Any] = {
        "discovery": {"nvidia_smi": str(smi)},
        "engines": {"vllm": {"bin": str(venv / "bin" / "vllm"), "launch_mode": "mp"}},
    }
    if models is not None:
        kw["model_dirs"] = [str(models)]
    return {**kw, **extra}


def node_copy(tiny_model: Path, root: Path) -> Path:
    """The tiny model copied to <root>/models/org/tiny, as a node's plain tree holds it;
    returns the models folder (for model_dirs)."""
    models = root / "models"
    shutil.copytree(tiny_model, models / "org" / "tiny")
    return models


def tiny_yaml(*, model: str = "org/tiny", replicas: int = 1, timeout: int = READY_TIMEOUT,
              args: Sequence[str] = ENGINE_ARGS, extra: str = "") -> str:
    """Deployment 'tiny' on vLLM, one GPU a replica (`extra`: more keys)."""
    return (f"name: tiny\nmodel: {model}\nengine: vllm\ngpus_per_node: 1\nreplicas: {replicas}\n"
            f"startup_timeout: {timeout}s\nargs: {json.dumps(list(args))}\n"
            f"env: {json.dumps(ENGINE_ENV)}\n{extra}")


def engine_log(root: Path, replica: str = "tiny-0", node: str = "cpu-1") -> Path:
    return root / "agents" / node / "work" / "engines" / replica / "engine.log"


def leaders(root: Path) -> list[int]:
    """The engines' main processes under `root` (session leaders: `vllm serve`'s API
    server; its EngineCore and workers are in its session)."""
    return [p for p in engine_pids(root) if procs.session_of(p) == p]

"""The simulated engine reads a model folder's files as far as vLLM's loader would before
it could serve: config.json must be JSON, and every safetensors file's header must be
whole and cover the file (what safetensors' safe_open checks first). A broken one ends the
start with safetensors' or transformers' own words, so that what the agent does with an
engine that cannot read its copy is tested without a real engine. An id, or a folder
without those files, is not read (the simulation has no weights to need)."""

from __future__ import annotations

import json
import os
import struct

READ_WEIGHTS_ENV = "LLMGW_SIM_READ_WEIGHTS"  # "1": read them (off: the suite's fake trees)
# safetensors (Rust) refuses a header longer than this. Its messages below are safetensors
# 0.8's (vLLM 0.32's venv), as safe_open raises them on such files.
MAX_HEADER = 100_000_000


def check_weights(model: str) -> str:
    """"" when `model` is not a folder or its files read; else the loader's error line."""
    if not os.path.isdir(model):
        return ""
    config = os.path.join(model, "config.json")
    if os.path.exists(config):
        try:
            with open(config, encoding="utf-8") as f:
                json.load(f)
        except (OSError, ValueError):
            # transformers' message for an unreadable config (configuration_utils.py)
            return f"OSError: It looks like the config file at '{config}' is not a valid JSON file."
    for name in sorted(os.listdir(model)):
        if name.endswith(".safetensors"):
            why = _safetensors_problem(os.path.join(model, name))
            if why:
                return ("safetensors._safetensors_rust.SafetensorError: Error while "
                        f"deserializing header: {why}")
    return ""


def _safetensors_problem(path: str) -> str:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return "header too small"
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER:
                return "header too large"
            if 8 + n > size:
                return "invalid header length"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as exc:
        return f"invalid JSON in header: {exc}"
    if not isinstance(header, dict):
        return "invalid JSON in header"
    end = max((v["data_offsets"][1] for k, v in header.items()
               if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v), default=0)
    if 8 + n + end != size:
        return "incomplete metadata, file not fully covered"
    return ""

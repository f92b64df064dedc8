"""Build model folders: plain layouts and the Hugging Face cache, complete or not."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def plain_model(
    root: Path,
    name: str,
    *,
    shards: int = 2,
    extra_files: int = 0,
    index: bool = True,
    missing_shard: int | None = None,
    empty_shard: int | None = None,
    shard_bytes: int = 16,
) -> Path:
    """`<root>/<name>/` with config.json, safetensors shards and their index.

    `name` may be `org/model`. `missing_shard`/`empty_shard`: that shard (0-based) is
    listed in the index but absent / zero bytes."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    for i, shard in enumerate(names):
        if i == missing_shard:
            continue
        _write(d / shard, b"" if i == empty_shard else b"w" * shard_bytes)
    if index:
        weight_map = {f"layer.{i}.weight": shard for i, shard in enumerate(names)}
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for k in range(extra_files):
        _write(d / f"extra_{k}.txt", b"x")
    return d


def hf_cache_model(
    cache: Path,
    org: str,
    name: str,
    *,
    revision: str = "a" * 40,
    ref: bool = True,
    incomplete_blob: bool = False,
    shards: int = 2,
) -> Path:
    """`<cache>/models--<org>--<name>/` as huggingface_hub lays it out: blobs/ by hash,
    snapshots/<rev>/ of relative symlinks into blobs/, refs/main. Returns the snapshot."""
    repo = cache / f"models--{org}--{name}"
    blobs = repo / "blobs"
    snap = repo / "snapshots" / revision
    blobs.mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    content: dict[str, bytes] = {
        "config.json": json.dumps({"architectures": ["LlamaForCausalLM"]}).encode(),
        "model.safetensors.index.json": json.dumps(
            {"weight_map": {f"l.{i}": s for i, s in enumerate(names)}}
        ).encode(),
        **{s: b"w" * (100 + i) for i, s in enumerate(names)},
    }
    for fname, data in content.items():
        digest = hashlib.sha256(data).hexdigest()
        _write(blobs / digest, data)
        os.symlink(f"../../blobs/{digest}", snap / fname)
    if incomplete_blob:
        _write(blobs / ("f" * 64 + ".incomplete"), b"partial")
    if ref:
        _write(repo / "refs" / "main", revision.encode())
    return snap

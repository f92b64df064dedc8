"""Scan time of model_dirs holding 1,000 models of 50 files each (target: under 1 s).

    .venv/bin/python bench/discovery_storage.py [models] [files-per-model]

Half plain layout (org/name), half Hugging Face cache (snapshot symlinks into blobs/).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from llmgw.agent.discovery.storage import scan_storage
from llmgw.config.agent import ModelDirConfig


def build_plain(root: Path, i: int, files: int) -> None:
    d = root / f"org{i % 20}" / f"model-{i}"
    d.mkdir(parents=True)
    shards = [f"model-{k:05d}-of-{files - 3:05d}.safetensors" for k in range(files - 3)]
    (d / "config.json").write_text("{}")
    (d / "tokenizer.json").write_text("{}")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {f"l{k}": s for k, s in enumerate(shards)}})
    )
    for s in shards:
        (d / s).write_bytes(b"w")


def build_hf(root: Path, i: int, files: int) -> None:
    repo = root / f"models--org--hf-{i}"
    blobs, snap = repo / "blobs", repo / "snapshots" / ("a" * 40)
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    shards = [f"model-{k:05d}-of-{files - 2:05d}.safetensors" for k in range(files - 2)]
    content = {
        "config.json": b"{}",
        "model.safetensors.index.json": json.dumps(
            {"weight_map": {f"l{k}": s for k, s in enumerate(shards)}}
        ).encode(),
        **{s: f"{i}-{s}".encode() for s in shards},
    }
    for name, data in content.items():
        h = hashlib.sha1(data).hexdigest()
        (blobs / h).write_bytes(data)
        os.symlink(f"../../blobs/{h}", snap / name)


def main() -> None:
    models = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    files = int(sys.argv[2]) if len(sys.argv) > 2 else 50
    with tempfile.TemporaryDirectory() as tmp:
        plain, hf = Path(tmp) / "plain", Path(tmp) / "hf"
        for i in range(models):
            (build_plain if i % 2 == 0 else build_hf)(plain if i % 2 == 0 else hf, i, files)
        dirs = (ModelDirConfig(str(plain)), ModelDirConfig(str(hf)))
        scan_storage(dirs, [])  # warm the dentry cache, as a periodic rescan finds it
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            scan = scan_storage(dirs, [])
            runs.append(time.perf_counter() - t0)
        complete = sum(m.complete for m in scan.report.models)
        print(
            f"{len(scan.report.models)} models x {files} files: best {min(runs):.3f} s, "
            f"worst {max(runs):.3f} s ({complete} complete)"
        )


if __name__ == "__main__":
    main()

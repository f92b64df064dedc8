"""Find model weights under `model_dirs`: plain trees and the Hugging Face cache.

A directory in, `ModelCopy`s out. An empty or half-written directory is not weights: it
is reported incomplete with the reason and never counts as holding the model.
"""

from __future__ import annotations

import json
import logging
import os

from attrs import evolve, frozen

from llmgw.agent.discovery.mountinfo import Mount, classify
from llmgw.agent.lifecycle.download_progress import downloaded, read_listing
from llmgw.config.agent import ModelDirConfig
from llmgw.model.inventory import ModelCopy, StorageReport

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
PARTIAL_SUFFIXES = (".incomplete", ".part", ".partial", ".tmp", ".aria2")
HF_PREFIX = "models--"
# Downloads under way reported from one download_dir, at most (a message stays bounded).
MAX_DOWNLOADS = 256


@frozen
class StorageScan:
    report: StorageReport
    warnings: tuple[str, ...] = ()


def _walk(top: str) -> tuple[dict[str, int], list[str]]:
    """Files under `top` (relative path -> size, -1 for a dangling link) and markers.

    Follows symlinks (HF snapshots link into blobs/) but never enters a directory twice,
    so a symlink loop ends. Hidden directories are skipped except the download cache
    `huggingface-cli --local-dir` leaves under .cache/, whose `.incomplete` files count.
    """
    files: dict[str, int] = {}
    markers: list[str] = []
    seen: set[tuple[int, int]] = set()
    stack = [("", top)]
    while stack:
        rel, path = stack.pop()
        try:
            st = os.stat(path)
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            seen.add(key)
            it = os.scandir(path)
        except OSError as exc:
            log.debug("cannot list %s: %s", path, exc)
            continue
        with it:
            for e in it:
                name = rel + e.name
                try:
                    is_dir = e.is_dir()
                except OSError:
                    is_dir = False
                if is_dir:
                    if e.name.startswith(".") and name != ".cache" and not rel.startswith(".cache"):
                        continue
                    stack.append((name + "/", e.path))
                    continue
                if e.name.endswith(PARTIAL_SUFFIXES):
                    markers.append(name)
                    continue
                if rel.startswith(".cache/"):
                    if e.name.endswith(".lock"):
                        continue  # the marker that matters is the .incomplete beside it
                    continue
                try:
                    files[name] = e.stat().st_size
                except OSError:
                    files[name] = -1  # dangling link
    return files, markers


def _unfinished_locks(files: dict[str, int]) -> list[str]:
    """`X.lock` beside an X that is missing or empty: a download still in progress."""
    return [n for n in files if n.endswith(".lock") and files.get(n[: -len(".lock")], 0) <= 0]


def check_complete(files: dict[str, int], markers: list[str], top: str) -> str:
    """Empty string when complete, else the reason (first problem found)."""
    if not files and not markers:
        return "empty directory"
    if markers:
        return f"partial download: {sorted(markers)[0]}"
    locks = _unfinished_locks(files)
    if locks:
        return f"download in progress: {sorted(locks)[0]}"
    if "config.json" not in files:
        return "no config.json"
    weights = [n for n in files if n.endswith(WEIGHT_SUFFIXES)]
    if not weights:
        return "no weight files (*.safetensors, *.bin, *.gguf)"
    for n in sorted(weights):
        if files[n] < 0:
            return f"missing weight file: {n}"
        if files[n] == 0:
            return f"empty weight file: {n}"
    for index in sorted(n for n in files if n.endswith(".index.json")):
        try:
            with open(os.path.join(top, index), "rb") as f:
                weight_map = json.load(f).get("weight_map", {})
            shards = set(weight_map.values())
        except (OSError, ValueError, AttributeError) as exc:
            return f"unreadable index {index}: {exc}"
        base = index.rsplit("/", 1)[0] + "/" if "/" in index else ""
        for shard in sorted(shards):
            size = files.get(base + str(shard))
            if size is None or size < 0:
                return f"shard {shard} listed in {index} is missing"
            if size == 0:
                return f"shard {shard} listed in {index} is empty"
    return ""


def scan_model(name: str, path: str) -> ModelCopy:
    files, markers = _walk(path)
    reason = check_complete(files, markers, path)
    size = sum(s for s in files.values() if s > 0)
    return ModelCopy(name=name, path=path, size=size, complete=not reason, reason=reason)


def _hf_snapshot(repo: str) -> tuple[str | None, str]:
    """(snapshot dir, reason): refs/main's snapshot if present, else the newest."""
    snaps = os.path.join(repo, "snapshots")
    try:
        with open(os.path.join(repo, "refs", "main")) as f:
            ref = f.read().strip()
    except OSError:
        ref = ""
    if ref and os.path.isdir(os.path.join(snaps, ref)):
        return os.path.join(snaps, ref), ""
    try:
        entries = [e for e in os.scandir(snaps) if e.is_dir()]
    except OSError:
        entries = []
    if not entries:
        return None, "no snapshot (download not finished)"
    newest = max(entries, key=lambda e: e.stat().st_mtime)
    return newest.path, ""


def _hf_blob_markers(repo: str) -> list[str]:
    """Partial-download markers in blobs/: a name listing, never the blobs' content."""
    try:
        with os.scandir(os.path.join(repo, "blobs")) as it:
            return ["blobs/" + e.name for e in it if e.name.endswith(PARTIAL_SUFFIXES)]
    except OSError:
        return []


def scan_hf_repo(entry_name: str, repo: str) -> ModelCopy:
    name = entry_name[len(HF_PREFIX) :].replace("--", "/", 1)
    markers = _hf_blob_markers(repo)
    snap, why = _hf_snapshot(repo)
    if snap is None:
        reason = f"partial download: {sorted(markers)[0]}" if markers else why
        return ModelCopy(name=name, path=repo, size=0, complete=False, reason=reason)
    copy = scan_model(name, snap)
    if markers and copy.complete:
        copy = evolve(copy, complete=False, reason=f"partial download: {sorted(markers)[0]}")
    return copy


def _looks_like_model(path: str) -> tuple[bool, bool]:
    """(holds model files directly, has subdirectories)."""
    model = subdirs = False
    try:
        with os.scandir(path) as it:
            for e in it:
                if e.name.startswith("."):
                    continue
                if e.is_dir():
                    subdirs = True
                elif e.name == "config.json" or e.name.endswith(
                    (*WEIGHT_SUFFIXES, *PARTIAL_SUFFIXES, ".index.json")
                ):
                    model = True
    except OSError as exc:
        log.debug("cannot list %s: %s", path, exc)
    return model, subdirs


def scan_dir(top: str) -> list[ModelCopy]:
    """Models under one `model_dirs` entry, in either layout, sorted by name."""
    found: list[ModelCopy] = []
    with os.scandir(top) as it:
        entries = sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
    for e in entries:
        if not e.is_dir():
            continue
        if e.name.startswith(HF_PREFIX):
            found.append(scan_hf_repo(e.name, e.path))
        else:
            model, subdirs = _looks_like_model(e.path)
            if model or not subdirs:  # an empty directory is reported, as incomplete
                found.append(scan_model(e.name, e.path))
                continue
            with os.scandir(e.path) as sub_it:
                subs = sorted(
                    (s for s in sub_it if s.is_dir() and not s.name.startswith(".")),
                    key=lambda s: s.name,
                )
            for s in subs:
                if s.name.startswith(HF_PREFIX):  # e.g. <dir>/hub/models--org--name
                    found.append(scan_hf_repo(s.name, s.path))
                else:
                    found.append(scan_model(f"{e.name}/{s.name}", s.path))
    return found


def free_space(path: str) -> int:
    """Bytes an unprivileged user may still write under `path`, or under its nearest
    existing parent (a download_dir the first download creates); -1 when unreadable."""
    probe = os.path.abspath(path)
    while True:
        try:
            st = os.statvfs(probe)
            return st.f_bavail * st.f_frsize
        except FileNotFoundError:
            parent = os.path.dirname(probe)
            if parent == probe:
                return -1
            probe = parent
        except OSError as exc:
            log.debug("cannot statvfs %s: %s", probe, exc)
            return -1


def scan_downloads(download_dir: str) -> dict[str, int]:
    """Model id -> bytes on disk, for each copy in `download_dir` (the hub cache layout an
    engine downloads into) that is not complete and has some bytes there: a download under
    way, or one cut short that the next engine resumes. A complete copy is not listed (the
    node holds it; the scan of model_dirs says so)."""
    try:
        with os.scandir(download_dir) as it:
            repos = sorted((e.name, e.path) for e in it
                           if e.name.startswith(HF_PREFIX) and e.is_dir())
    except OSError:
        return {}
    out: dict[str, int] = {}
    for name, path in repos:
        copy = scan_hf_repo(name, path)
        held = 0 if copy.complete else downloaded(read_listing(path))
        if held > 0:
            out[copy.name] = held
            if len(out) >= MAX_DOWNLOADS:
                break
    return out


def scan_storage(model_dirs: tuple[ModelDirConfig, ...] | None, mounts: list[Mount],
                 download_dir: str = "") -> StorageScan:
    """Walk every configured directory. None: the node was not asked (asked=False).
    `download_dir` (agent.yaml's, "" for none): its free space is reported too, and the
    downloads under way there (read before the free space, so that a download growing
    between the two reads is counted short, never twice)."""
    downloading = scan_downloads(download_dir) if download_dir else {}
    free = free_space(download_dir) if download_dir else -1
    if model_dirs is None:
        return StorageScan(StorageReport(asked=False, download_dir=download_dir,
                                         download_free=free, downloading=downloading))
    models: list[ModelCopy] = []
    warnings: list[str] = []
    for d in model_dirs:
        real = os.path.realpath(d.path)
        try:
            copies = scan_dir(real)
        except OSError as exc:
            warnings.append(f"model_dirs: cannot read {d.path}: {exc.strerror or exc}")
            continue
        shared, store = classify(mounts, real)
        if d.shared is not None:
            shared = d.shared
        if shared:
            store = d.store or store or real
        else:
            if d.store and d.shared is None:
                warnings.append(
                    f"model_dirs: {d.path} has store {d.store!r} but is on local storage; "
                    "treated as local (say shared: true to override)"
                )
            store = ""
        for c in copies:
            if c.reason:
                warnings.append(f"model {c.name} at {c.path} is incomplete: {c.reason}")
            models.append(evolve(c, shared=shared, store=store))
    report = StorageReport(asked=True, models=tuple(models), download_dir=download_dir,
                           download_free=free, downloading=downloading)
    return StorageScan(report, tuple(warnings))

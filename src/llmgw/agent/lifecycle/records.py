"""Engine records on disk: the handle that lets a restarted agent adopt its engines.

One record per replica at <work_dir>/engines/<replica>/record.json, written atomically
(write a temporary file, fsync, rename, fsync the folder). A record is written as
"pending" (pid 0) before the spawn and completed with the pid, session id and process
start time right after it, before the engine is reported as started. A record holds the
engine's API key: it is readable by the agent's user only (0600).
"""

from __future__ import annotations

import json
import logging
import os
import secrets

from attrs import evolve, field, frozen
from cattrs.preconf.json import make_converter

from llmgw.model.engine import EngineSpec

log = logging.getLogger(__name__)

RECORD = "record.json"
LOG = "engine.log"

_conv = make_converter()


@frozen
class EngineRecord:
    spec: EngineSpec
    log_path: str
    pid: int = 0  # 0: pending, the spawn may or may not have happened
    sid: int = 0
    start_time: int = 0  # /proc/<pid>/stat field 22
    ports: tuple[int, ...] = ()
    restarts: int = 0
    # NVML's index of each of spec.gpus, in that order: what CUDA_VISIBLE_DEVICES got
    # (the UUIDs stay in the spec). Empty: no GPUs, or a record from before indices.
    cuda_devices: tuple[int, ...] = ()
    # The weights it was started on (Weights.reason: the copy's path, local or shared, the
    # store; or the download folder), reported again when the engine is adopted.
    weights: str = ""
    # MiB free on each of spec.gpus right before the spawn, in that order: what "its memory
    # is back" means after it ends (gpu_release.still_held), for an adopted engine too.
    # Empty: not read (a record from before, or no GPU reader).
    gpu_free_before: tuple[int, ...] = ()
    # The engine's own API key (engine keys; engines/keys.py says how the engine gets it):
    # made before the spawn, kept here so that an adopting agent sends the same one.
    # "": a record from before keys (that engine was started without one).
    api_key: str = field(default="", repr=False)

    @property
    def pending(self) -> bool:
        return self.pid == 0

    def completed(self, pid: int, sid: int, start_time: int) -> EngineRecord:
        return evolve(self, pid=pid, sid=sid, start_time=start_time)


def new_key() -> str:
    """A fresh engine key: 256 random bits, url-safe base64 (no character an HTTP header,
    YAML or a shell would treat specially), after a prefix that says whose it is and
    makes it start with a letter (never read as a flag when SGLang turns it into argv)."""
    return "llmgw-" + secrets.token_urlsafe(32)


def engine_dir(work_dir: str, replica_id: str) -> str:
    if not replica_id or "/" in replica_id or replica_id in (".", ".."):
        raise ValueError(f"replica id {replica_id!r} cannot name a folder")
    return os.path.join(work_dir, "engines", replica_id)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_record(work_dir: str, record: EngineRecord) -> None:
    folder = engine_dir(work_dir, record.spec.replica_id)
    os.makedirs(folder, exist_ok=True)
    data = json.dumps(_conv.unstructure(record), indent=1, sort_keys=True).encode()
    final = os.path.join(folder, RECORD)
    tmp = final + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        # A temporary file left by a crash keeps the mode it was made with: set it again.
        os.fchmod(fd, 0o600)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    _fsync_dir(folder)


def remove_record(work_dir: str, replica_id: str) -> None:
    folder = engine_dir(work_dir, replica_id)
    try:
        os.unlink(os.path.join(folder, RECORD))
    except FileNotFoundError:
        return
    _fsync_dir(folder)


def read_records(work_dir: str) -> list[EngineRecord]:
    """Every readable record; an unreadable one is logged and skipped (never deleted)."""
    root = os.path.join(work_dir, "engines")
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        path = os.path.join(root, name, RECORD)
        try:
            with open(path, "rb") as f:
                raw = json.loads(f.read())
            out.append(_conv.structure(raw, EngineRecord))
        except FileNotFoundError:
            continue
        except Exception as exc:  # a corrupt record must not stop the agent
            log.error("skipping unreadable engine record %s: %s", path, exc)
    return out

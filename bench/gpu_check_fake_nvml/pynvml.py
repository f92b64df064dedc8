"""A stand-in for the `pynvml` module, for `bench/gpu_check.py --engine simulated`.

Put this folder first on PYTHONPATH of an llmgw agent and it "finds" GPUs through NVML
that the JSON file named by LLMGW_FAKE_NVML describes, re-read whenever the file changes:

    {"gpus": 1, "total_mib": 81920,
     "processes": {"0": [[4242, 73014]]}}      # NVML index -> [[pid, MiB], ...]

Free memory is the total less 1 GiB (the driver's own) less what the processes hold,
so a process the check lists here holds memory for placement and the supervisor the way
a foreign process on a real GPU does. Every function is tests/fakes' FakeNvml's.

Processes list themselves too, as the torch stand-in for vLLM does in its fake-CUDA mode
(bench/gpu_check_vllm.py): <state file>.holds/<pid>.json, {"<NVML index>": MiB}, counted
for as long as that pid lives (not a zombie), so a SIGKILLed holder's memory comes back
when it exits, as the driver gives it back.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from fakes.nvidia_smi import FakeNvml, FakeNVMLError  # noqa: E402

MIB = 1024 * 1024
STATE_ENV = "LLMGW_FAKE_NVML"
NVMLError = FakeNVMLError


def bus(i: int) -> str:
    return f"00000000:{i + 0x18:02X}:00.0"


def holds_dir(state: str) -> Path:
    return Path(state + ".holds")


def alive(pid: int) -> bool:
    """Running (a zombie has closed its device files: its memory is back)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def holdings(state: str) -> dict[int, dict[int, int]]:
    """pid -> {NVML index: MiB} of every live process that lists itself."""
    out: dict[int, dict[int, int]] = {}
    try:
        files = list(holds_dir(state).glob("*.json"))
    except OSError:
        return out
    for f in files:
        if not f.stem.isdigit() or not alive(int(f.stem)):
            continue
        try:
            doc = json.loads(f.read_text())
            out[int(f.stem)] = {int(k): int(v) for k, v in doc.items()}
        except (OSError, ValueError, AttributeError):
            continue  # written right now, or by something else: read at the next call
    return out


class StateNvml(FakeNvml):
    """FakeNvml whose memory follows its processes."""

    def __init__(self, state: dict[str, Any]) -> None:
        count = int(state.get("gpus", 1))
        procs = {int(k): [(int(pid), int(mib) * MIB) for pid, mib in v]
                 for k, v in dict(state.get("processes", {})).items()}
        super().__init__([bus(i) for i in range(count)], processes=procs,
                         uuids=[f"GPU-fake{i:04d}-0000-0000-0000-{i:012d}" for i in range(count)])
        self.total = int(state.get("total_mib", 80 * 1024)) * MIB

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        self._check(h, "nvmlDeviceGetMemoryInfo")
        used = MIB * 1024 + sum(b or 0 for _pid, b in self.processes.get(h, []))
        used = min(used, self.total)
        return SimpleNamespace(total=self.total, free=self.total - used, used=used)


_cache: tuple[Any, StateNvml] | None = None


def current() -> StateNvml:
    """The fake as the state file and the live holders say now (a missing or unreadable
    file: one idle GPU)."""
    global _cache
    path = os.environ.get(STATE_ENV, "")
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError:
        stamp = -1
    held = holdings(path) if path else {}
    key = (stamp, json.dumps(sorted(held.items())))
    if _cache is None or _cache[0] != key:
        try:
            with open(path) as f:
                state = json.load(f)
        except (OSError, ValueError):
            state = {}
        state = state if isinstance(state, dict) else {}
        procs = {str(k): list(v) for k, v in dict(state.get("processes", {})).items()}
        for pid, per_gpu in held.items():
            for index, mib in per_gpu.items():
                procs.setdefault(str(index), []).append([pid, mib])
        _cache = (key, StateNvml({**state, "processes": procs}))
    return _cache[1]


def __getattr__(name: str) -> Any:
    return getattr(current(), name)

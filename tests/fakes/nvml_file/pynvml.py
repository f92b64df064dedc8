"""A stand-in for the `pynvml` module for live tests of GPU health (issue 30 item 3).

Put this folder first on an llmgw agent's PYTHONPATH and it reads its GPUs through
tests/fakes' FakeNvml, as the JSON file named by LLMGW_TEST_NVML describes, re-read
whenever the file changes:

    {"gpus": 2, "remap_pending": [0], "ecc": {"1": 3}, "recovery": {"1": 1},
     "xids": [[1, 48]]}

"xids" are Xid events in the order they happened: each is delivered once, to the agent's
Xid watch, however often the file is rewritten (append to the list for another).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fakes.nvidia_smi import NVML_ERROR_TIMEOUT, FakeNvml, FakeNVMLError  # noqa: E402

STATE_ENV = "LLMGW_TEST_NVML"
NVMLError = FakeNVMLError

_lock = threading.Lock()
_delivered = 0  # Xid events handed to a wait so far
_cache: tuple[int, FakeNvml] | None = None


def _state() -> tuple[int, dict[str, Any]]:
    path = os.environ.get(STATE_ENV, "")
    try:
        stamp = os.stat(path).st_mtime_ns
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return -1, {}
    return stamp, doc if isinstance(doc, dict) else {}


class FileNvml(FakeNvml):
    def __init__(self, doc: dict[str, Any]) -> None:
        count = int(doc.get("gpus", 1))
        super().__init__([f"00000000:{i + 0x18:02X}:00.0" for i in range(count)],
                         uuids=[f"GPU-file{i:04d}-0000-0000-0000-{i:012d}" for i in range(count)],
                         remap_pending=set(doc.get("remap_pending", [])),
                         ecc={int(k): int(v) for k, v in dict(doc.get("ecc", {})).items()},
                         recovery={int(k): int(v) for k, v in dict(doc.get("recovery", {})).items()})
        self.all_xids = [(int(h), int(x)) for h, x in doc.get("xids", [])]

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any:
        global _delivered
        with _lock:
            if _delivered < len(self.all_xids):
                h, xid = self.all_xids[_delivered]
                _delivered += 1
                return SimpleNamespace(device=h, eventType=self.nvmlEventTypeXidCriticalError,
                                       eventData=xid, gpuInstanceId=0, computeInstanceId=0)
        raise FakeNVMLError(NVML_ERROR_TIMEOUT)


def current() -> FakeNvml:
    global _cache
    stamp, doc = _state()
    with _lock:
        if _cache is None or _cache[0] != stamp:
            _cache = (stamp, FileNvml(doc))
        return _cache[1]


def __getattr__(name: str) -> Any:
    return getattr(current(), name)

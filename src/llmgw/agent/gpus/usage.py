"""Per-GPU memory use and utilisation from NVML, read when the agent's /metrics is scraped.

Blocking (NVML calls): run `GpuSampler.sample` in `trio.to_thread`. The NVML session is
opened once and kept (nvmlInit costs far more than a read, and is reference-counted, so
discovery's own init/shutdown do not close it); after a failure it is closed and tried
again at most every RETRY seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from attrs import frozen

log = logging.getLogger(__name__)

RETRY = 60.0  # seconds between attempts to open NVML after it failed


@frozen
class GpuUsage:
    index: int
    uuid: str
    memory_used: int  # bytes
    memory_total: int  # bytes
    utilization: float | None  # 0..1 over NVML's last sample period; None: not reported


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _read_one(nvml: Any, i: int) -> GpuUsage:
    h = nvml.nvmlDeviceGetHandleByIndex(i)
    mem = nvml.nvmlDeviceGetMemoryInfo(h)
    try:
        util: float | None = int(nvml.nvmlDeviceGetUtilizationRates(h).gpu) / 100.0
    except Exception as exc:  # NotSupported on some boards and in MIG mode
        log.debug("GPU %d utilisation: %s", i, exc)
        util = None
    return GpuUsage(i, _text(nvml.nvmlDeviceGetUUID(h)), int(mem.used), int(mem.total), util)


def read_usage(nvml: Any) -> list[GpuUsage]:
    """Every GPU's use that NVML can read; `nvml.nvmlInit` must have succeeded.

    A GPU that fails (lost) is left out, with a debug line: discovery reports it as a
    problem, and the others' figures still count. Raises when NVML cannot count the GPUs,
    or when every GPU failed (the session itself is broken: the sampler reopens it)."""
    out = []
    first_error: Exception | None = None
    count = int(nvml.nvmlDeviceGetCount())
    for i in range(count):
        try:
            out.append(_read_one(nvml, i))
        except Exception as exc:
            log.debug("GPU %d usage: %s; left out", i, exc)
            first_error = first_error or exc
    if count and not out and first_error is not None:
        raise first_error
    return out


class GpuSampler:
    """An NVML session for the metrics; `sample()` -> usage, or None when NVML does not answer."""

    def __init__(self, nvml: Any | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.nvml = nvml
        self.clock = clock
        self.open = False
        self.failed_at: float | None = None

    def sample(self) -> list[GpuUsage] | None:
        if self.nvml is None:
            return None
        if not self.open:
            if self.failed_at is not None and self.clock() - self.failed_at < RETRY:
                return None
            try:
                self.nvml.nvmlInit()
            except Exception as exc:
                self._failed(f"NVML did not load ({exc})")
                return None
            self.open = True
        try:
            return read_usage(self.nvml)
        except Exception as exc:
            self._failed(f"NVML read failed ({exc})")
            self.close()
            return None

    def _failed(self, why: str) -> None:
        if self.failed_at is None:
            log.info("GPU metrics: %s; memory from the last discovery, no utilisation", why)
        self.failed_at = self.clock()

    def close(self) -> None:
        if self.open and self.nvml is not None:
            self.open = False
            try:
                self.nvml.nvmlShutdown()
            except Exception as exc:
                log.debug("nvmlShutdown: %s", exc)

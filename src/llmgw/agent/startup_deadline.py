"""When an engine that is not ready yet has had long enough: pure, times and sizes in.

A fixed 600 s from spawn restarts a 70B model in a loop (≈140 GB of bf16 weights take
≈470 s at 300 MB/s before torch.compile and CUDA-graph capture even begin). Instead:

- progress extends the deadline: while the engine's log grows (loading bars, compile
  and capture messages), or its download of the weights grows on disk (the hub client
  logs nothing to a file while it fetches 140 GB), it gets the spec's `startup_timeout`
  again from the last growth;
- the weights set a floor: `startup_timeout` + their size read at WEIGHTS_READ_RATE;
- a hard cap bounds the extension, so that an engine that logs a warning forever while
  never serving is still given up on.
"""

from __future__ import annotations

from attrs import evolve, frozen

# Bytes per second an engine is assumed to read its weights at, for the floor. Slow on
# purpose: a spinning disk or a busy filer serving several nodes at once gives 150-300
# MB/s, a local NVMe several GB/s. Too slow an assumption only delays giving up on a hung
# engine by a few minutes; too fast a one restarts a healthy load in a loop.
WEIGHTS_READ_RATE = 200e6


def weights_floor(timeout: float, size_bytes: int, rate: float = WEIGHTS_READ_RATE) -> float:
    """Seconds from spawn before which a start never times out."""
    return timeout + max(0, size_bytes) / rate


@frozen
class StartupDeadline:
    """The startup clock of one engine. `observe` each health interval with the log's size."""

    began: float  # spawn time (trio's clock)
    timeout: float  # the spec's startup_timeout: seconds allowed without progress
    floor: float  # seconds from `began`: never given up on before
    cap: float  # seconds from `began`: given up on at the latest
    last_progress: float
    last_size: int
    last_downloaded: int = 0  # bytes of the weights' download on disk (download_progress)

    @classmethod
    def start(cls, began: float, timeout: float, *, cap: float, size_bytes: int = 0,
              log_size: int = 0, downloaded: int = 0) -> StartupDeadline:
        floor = weights_floor(timeout, size_bytes)
        # The weights' floor wins over the cap: a model whose mere read takes longer than
        # the cap would otherwise never start anywhere.
        return cls(began, timeout, floor, max(cap, floor), began, log_size, downloaded)

    def observe(self, log_size: int, now: float, downloaded: int = 0) -> StartupDeadline:
        """A new sample of the log's size and the download's bytes on disk; any change of
        either is progress (a rotation shrinks the log, a finished file's rename may
        shrink the download's listing for a moment)."""
        if log_size == self.last_size and downloaded == self.last_downloaded:
            return self
        return evolve(self, last_progress=now, last_size=log_size, last_downloaded=downloaded)

    @property
    def deadline(self) -> float:
        idle = self.last_progress + self.timeout
        return min(self.began + self.cap, max(self.began + self.floor, idle))

    def expired(self, now: float) -> str:
        """"" while there is time left; else why not, for the engine's failure reason."""
        if now < self.deadline:
            return ""
        elapsed = now - self.began
        if self.deadline >= self.began + self.cap:
            return f"not ready within {elapsed:.0f}s (the {self.cap:.0f}s cap)"
        return f"not ready within {elapsed:.0f}s (no progress for {now - self.last_progress:.0f}s)"

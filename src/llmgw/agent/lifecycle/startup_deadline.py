"""When an engine that is not ready yet has had long enough: pure, times and sizes in.

A fixed 600 s from spawn restarts a 70B model in a loop (≈140 GB of bf16 weights take
≈470 s at 300 MB/s before torch.compile and CUDA-graph capture even begin). Instead:

- progress extends the deadline: while the engine's log grows (loading bars, compile
  and capture messages), or its download of the weights grows on disk (the hub client
  logs nothing to a file while it fetches 140 GB), it gets the spec's `startup_timeout`
  again from the last growth;
- the weights set a floor: `startup_timeout` + their size read at WEIGHTS_READ_RATE;
- a hard cap bounds the extension, so that an engine that logs a warning forever while
  never serving is still given up on;
- what the new log bytes say, not only their size: lines known to mean waiting (WAITING)
  are not progress. vLLM's "No available shared memory broadcast block found in 60
  seconds" comes every 60 s from a first forward deadlocked across TP ranks as well as
  from a long compile; counted as progress, a deadlocked start held its GPUs for
  startup_max. The shell reads the new bytes (at most TAIL_MAX) and passes them in.
"""

from __future__ import annotations

import re

from attrs import evolve, frozen

# Log lines that say an engine waits, not that it moves on. vLLM's shm_broadcast.py
# LONG_WAIT_TIME_LOG_MSG ("No available shared memory broadcast block found in %d
# seconds. This typically happens when some processes are hanging or doing some
# time-consuming work (e.g. compilation, weight/kv cache quantization).", logged every
# VLLM_RINGBUFFER_WARNING_INTERVAL seconds by a writer whose readers do not read). Its
# start, middle and end each identify it, so that a read that caught the line half
# written still knows either half (unless the cut falls inside one of these phrases).
WAITING = re.compile(rb"No available shared memory broadcast block found|"
                     rb"when some processes are hanging|weight/kv cache quantization\)\.")
# The most new log bytes the shell reads per look. More than that between two looks
# (a few seconds) is progress: a waiting engine writes one line a minute.
TAIL_MAX = 64 * 1024
_SEGMENTS = re.compile(rb"[\r\n]+")


def says_progress(new: bytes) -> bool:
    """Whether `new` bytes of an engine's log say it moved on: some line in them (split at
    \\n and \\r, for progress bars) that is not blank and not a WAITING line."""
    return any(seg.strip() and not WAITING.search(seg) for seg in _SEGMENTS.split(new))

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
    # The log grew since the last progress, by WAITING lines only: said when given up on.
    waiting: bool = False

    @classmethod
    def start(cls, began: float, timeout: float, *, cap: float, size_bytes: int = 0,
              log_size: int = 0, downloaded: int = 0) -> StartupDeadline:
        floor = weights_floor(timeout, size_bytes)
        # The weights' floor wins over the cap: a model whose mere read takes longer than
        # the cap would otherwise never start anywhere.
        return cls(began, timeout, floor, max(cap, floor), began, log_size, downloaded)

    def observe(self, log_size: int, now: float, downloaded: int = 0,
                new: bytes | None = None) -> StartupDeadline:
        """A new sample of the log's size and the download's bytes on disk; a change of
        the download is progress (a finished file's rename may shrink its listing for a
        moment), and so is the log's, unless `new` (the log's bytes from last_size on, at
        most TAIL_MAX: the last ones) says only WAITING lines. None: the bytes were not
        read, any change counts; a rotated (shrunk) log counts too."""
        if log_size == self.last_size and downloaded == self.last_downloaded:
            return self
        # More new bytes than were read (TAIL_MAX of them, the last): progress, see TAIL_MAX.
        moved = (downloaded != self.last_downloaded or new is None or log_size < self.last_size
                 or log_size - self.last_size > len(new) or says_progress(new))
        if not moved:  # read past, so that the same lines are not judged again
            return evolve(self, last_size=log_size, waiting=True)
        return evolve(self, last_progress=now, last_size=log_size, last_downloaded=downloaded,
                      waiting=False)

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
        idle = f"no progress for {now - self.last_progress:.0f}s"
        if self.waiting:
            idle += ", the log saying only that it waits (a hang, or a compile longer than startup_timeout)"
        return f"not ready within {elapsed:.0f}s ({idle})"

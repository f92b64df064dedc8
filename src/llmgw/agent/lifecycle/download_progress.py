"""How far an engine's download of its weights has got: bytes on disk and the rate.

An engine with no copy on its node downloads into download_dir (agent/engines/weights.py),
in the Hugging Face cache layout: `<download_dir>/models--org--name/blobs/<sha>`, each
file written as `<sha>.incomplete` until it is whole. The bytes under blobs/ (the
incomplete ones included) are how far it has got; huggingface_hub prints its progress
bars only to a terminal, so the engine's log may stay still for the whole download, and
the startup deadline counts this growth as progress instead (startup_deadline.py).

Pure: `downloaded` and `DownloadProgress` take listings and times; `read_listing` is the
thin reader (one scandir of one folder, no file opened).
"""

from __future__ import annotations

import logging
import os
import posixpath
from collections.abc import Iterable

from attrs import evolve, frozen

log = logging.getLogger(__name__)

HF_REPO_PREFIX = "models--"


def repo_dir(download_dir: str, model: str) -> str:
    """Where the hub client puts `model` ("org/name") under `download_dir`."""
    return posixpath.join(download_dir, HF_REPO_PREFIX + model.replace("/", "--"))


def downloaded(listing: Iterable[tuple[str, int]]) -> int:
    """Bytes on disk in a listing of (name, size); an unreadable entry (size < 0) is 0."""
    return sum(max(0, size) for _, size in listing)


@frozen
class DownloadProgress:
    """Samples of the bytes on disk; `observe` each few seconds while the engine starts."""

    first_bytes: int
    first_at: float
    last_bytes: int
    last_at: float
    rate: float = 0.0  # bytes/s between the last two samples that were apart in time

    @classmethod
    def start(cls, size: int, now: float) -> DownloadProgress:
        return cls(size, now, size, now)

    def observe(self, size: int, now: float) -> DownloadProgress:
        dt = now - self.last_at
        if dt <= 0:
            return evolve(self, last_bytes=size)
        return evolve(self, last_bytes=size, last_at=now,
                      rate=max(0.0, (size - self.last_bytes) / dt))

    @property
    def started(self) -> bool:
        """Something was written since the first sample (a download under way or done)."""
        return self.last_bytes != self.first_bytes

    def line(self) -> str:
        """'12.3 GB on disk, 210 MB/s' for describe and the status page; "" before any
        byte arrived (an engine that had what it needed already downloads nothing)."""
        if self.last_bytes <= 0 and not self.started:
            return ""
        return f"{_si(self.last_bytes)} on disk, {_si(self.rate)}/s"


def _si(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def read_listing(repo: str) -> list[tuple[str, int]]:
    """(name, size) of the files in `repo`/blobs; empty when it is not there yet."""
    out: list[tuple[str, int]] = []
    try:
        with os.scandir(posixpath.join(repo, "blobs")) as it:
            for e in it:
                try:
                    out.append((e.name, e.stat(follow_symlinks=False).st_size))
                except OSError:
                    out.append((e.name, -1))  # gone between the listing and the stat
    except FileNotFoundError:
        return []  # the download has not begun
    except OSError as exc:
        log.debug("cannot list %s/blobs: %s", repo, exc)
    return out

"""The health watcher of one engine: its /health probe (injected; the real one is
health.http_health), the check that a 200 comes from the engine's own session, its
requests in flight once ready, its download's progress, and its startup deadline.

The counting is health.py's and the deadline startup_deadline.py's (both pure); this turns
what they say into the engine's lifecycle events through the supervisor's callbacks."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Protocol

import trio
from attrs import evolve

from llmgw.agent.discovery.procnet import PortConflict
from llmgw.agent.lifecycle.download_progress import DownloadProgress, downloaded, read_listing
from llmgw.agent.lifecycle.engine import Engine
from llmgw.agent.lifecycle.health import HealthEvent, http_health, probe_timeout, watch_health
from llmgw.agent.lifecycle.inflight import changed as inflight_changed
from llmgw.agent.lifecycle.inflight import read_in_flight
from llmgw.agent.lifecycle.startup_deadline import TAIL_MAX, StartupDeadline
from llmgw.agent.lifecycle.states import EngineEvent, Phase
from llmgw.agent.process import ports
from llmgw.config.agent import SupervisorConfig
from llmgw.model.engine import EngineSpec

log = logging.getLogger(__name__)

# Once ready, whether the socket answering health is the engine's own is checked again
# every this many successful probes (a /proc walk; every probe would be wasteful).
OWNER_CHECK_EVERY = 30
# Seconds between reports of a download's bytes on disk (each a message to the server):
# often enough that `describe` moves, seldom enough to cost nothing at a hundred engines.
DOWNLOAD_REPORT_EVERY = 5.0


class HealthProbe(Protocol):
    """GET /health of an engine: True on a 200 within `timeout` (health.http_health)."""

    async def __call__(self, host: str, port: int, *, timeout: float = ...,
                       path: str = ..., key: str = ...) -> bool: ...


class HealthWatch:
    """Watches engines' health for one supervisor; each callback runs on the event loop."""

    def __init__(
        self,
        host: str,
        config: SupervisorConfig,
        *,
        on_event: Callable[..., None],
        on_conflict: Callable[[Engine, PortConflict], None],
        on_report: Callable[[Engine], None],
        on_probe: Callable[[float, bool], None],
        model_size: Callable[[str], int] | None,
        download_repo: Callable[[EngineSpec], str],
        probe: HealthProbe = http_health,
    ) -> None:
        self.host = host
        self.config = config
        self.on_event = on_event  # (engine, EngineEvent, reason, **report changes)
        self.on_conflict = on_conflict
        self.on_report = on_report  # the engine's report changed: send it
        self.on_probe = on_probe  # each probe's duration and answer, for the metrics
        # Bytes of the complete local copy of a model (0: unknown), for the startup floor.
        # Called on the event loop: it must not block.
        self.model_size = model_size
        self.download_repo = download_repo
        self.probe = probe
        self.download_report_every = DOWNLOAD_REPORT_EVERY

    def _size_of(self, eng: Engine) -> int:
        if self.model_size is None:
            return 0
        try:
            return max(0, int(self.model_size(eng.spec.model)))
        except Exception as exc:  # the floor is a help, never a reason not to start
            log.warning("engine %s: size of %s unknown: %s", eng.spec.replica_id,
                        eng.spec.model, exc)
            return 0

    async def watch(self, eng: Engine) -> None:
        host, port = self.host, eng.spec.port
        answered = 0
        timeout = probe_timeout(eng.spec.engine, eng.spec.env, self.config.health_timeout)
        size = self._size_of(eng)
        # An engine downloading its weights: the bytes on disk, reported and counted as
        # progress (download_progress.py); "": it loads a copy, nothing to watch.
        repo = self.download_repo(eng.spec)

        async def on_disk() -> int:
            # In a thread: download_dir may be on NFS or Lustre, and a stuck server must
            # not stop the agent's loop (its heartbeats) while this engine starts.
            return await trio.to_thread.run_sync(lambda: downloaded(read_listing(repo)),
                                                 abandon_on_cancel=True)

        began = trio.current_time()
        listed = await on_disk() if repo else 0
        progress = DownloadProgress.start(listed, began)
        told = began
        clock = StartupDeadline.start(began, eng.spec.startup_timeout,
                                      cap=self.config.startup_max, size_bytes=size,
                                      log_size=_size(eng.record.log_path),
                                      downloaded=progress.last_bytes)

        def deadline(now: float) -> float:
            nonlocal clock, progress, told
            if repo:
                progress = progress.observe(listed, now)
                if now - told >= self.download_report_every:
                    told = now
                    line = progress.line()
                    if line != eng.report.download:
                        eng.report = evolve(eng.report, download=line)
                        self.on_report(eng)
            # The new bytes too: lines that only say the engine waits are not progress.
            size = _size(eng.record.log_path)
            clock = clock.observe(size, now, progress.last_bytes,
                                  _new_bytes(eng.record.log_path, clock.last_size, size))
            return clock.deadline

        async def probe() -> bool:
            nonlocal answered, listed
            if repo and eng.state is not Phase.READY:  # what deadline() observes next
                listed = await on_disk()
            began = trio.current_time()
            ok = await self.probe(host, port, timeout=timeout, key=eng.record.api_key)
            self.on_probe(trio.current_time() - began, ok)
            if not ok:
                return False
            if eng.state is Phase.READY:
                await self._note_in_flight(eng, timeout)
            # A 200 counts only from the engine's own session: on the way to ready, and
            # every OWNER_CHECK_EVERY answers after that.
            due = eng.state is not Phase.READY or answered % OWNER_CHECK_EVERY == 0
            answered += 1
            if not due or eng.record.sid <= 0:
                return True
            conflict = await trio.to_thread.run_sync(ports.owner_conflict, host, port,
                                                     eng.record.sid)
            if conflict is None:
                return True
            self.on_conflict(eng, conflict)
            return False

        def on_event(event: HealthEvent) -> None:
            if event is HealthEvent.READY:
                self.on_event(eng, EngineEvent.HEALTH_OK, "health check answered 200")
            elif event is HealthEvent.UNHEALTHY:
                self.on_event(eng, EngineEvent.HEALTH_FAIL, "three health checks failed in a row")
            else:
                now = trio.current_time()
                why = clock.expired(now) or f"not ready within {now - clock.began:.0f}s"
                # FAILED => stop: the lifecycle asks it (states.FAILURE_STOPS).
                self.on_event(eng, EngineEvent.STARTUP_TIMEOUT, why)

        await watch_health(probe, interval=self.config.health_interval,
                           startup_timeout=eng.spec.startup_timeout, on_event=on_event,
                           deadline=deadline)

    async def _note_in_flight(self, eng: Engine, timeout: float) -> None:
        """Read the engine's requests in flight; report when it moved between none, some
        and unknown (inflight.py): what ends a drain early."""
        n = await read_in_flight(self.host, eng.spec.port, timeout=timeout,
                                 key=eng.record.api_key)
        if inflight_changed(eng.report.in_flight, n):
            eng.report = evolve(eng.report, in_flight=n)
            self.on_report(eng)


def _size(path: str) -> int:
    """The size of an engine's log (its progress while starting); -1 when unreadable."""
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


def _new_bytes(path: str, since: int, size: int) -> bytes | None:
    """The log's bytes from `since` to `size`, the last TAIL_MAX of them (what the startup
    deadline judges); b"" when it did not grow, None when they cannot be read. A few KiB
    of a local file, read on the loop as _size stats it."""
    if size <= since or since < 0:
        return b""
    start = max(since, size - TAIL_MAX)
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(size - start)
    except OSError:
        return None

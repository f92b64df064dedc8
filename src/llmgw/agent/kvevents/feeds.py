"""Each KV-events engine's receiver, feeding the relay, for as long as the supervisor holds
the engine: begun before the engine spawns (its publisher's first batches then find the
port bound), or when an engine is adopted (its publisher reconnects by itself), and ended
when the engine exits or is stopped.

Every begin is a new life for the replica in the relay: a fresh stream's engine_started
clears, and the sink turns the clear into the life. What the relay held before (an agent
that just started holds nothing; a restarted engine's cache is empty) no longer describes
the engine. An adopted engine's publisher is well past seq 0: the stream's first batch is a
gap, and the engine's replay buffer fills it (or the stream clears again and goes on).

Events are a routing hint: an engine whose port cannot be bound still starts, without them
(a warning says so), and the relay answers its routers Gone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import trio
import zmq

from llmgw.agent.engines import kv_events
from llmgw.agent.kvevents.receiver import serve_kv_receiver
from llmgw.agent.kvevents.relay_serve import RelayService, RelaySink
from llmgw.agent.kvevents.stream import Clear, Stream
from llmgw.errors import LlmgwError
from llmgw.model.engine import EngineSpec

log = logging.getLogger(__name__)

# A replica's last receiver, ended a moment ago, leaves its port to ZeroMQ's own thread to
# close: a new one waits this long for the port to come free.
BIND_WAIT = 2.0
_BIND_RETRY = 0.02


class KvFeeds:
    """The receivers of one supervisor's engines. `ctx`: the agent's zmq context, set
    before the supervisor serves (None: no receivers)."""

    def __init__(self, service: RelayService, ctx: zmq.Context[Any] | None = None) -> None:
        self.service = service
        self.ctx = ctx
        self._feeds: dict[str, tuple[trio.CancelScope, RelaySink]] = {}

    def feeding(self) -> tuple[str, ...]:
        return tuple(self._feeds)

    async def begin(self, nursery: trio.Nursery, spec: EngineSpec) -> None:
        """Start `spec`'s receiver in `nursery` when its engine publishes events: bound when
        this returns. A receiver it had is ended first."""
        if not kv_events.publishes(spec) or self.ctx is None:
            return
        rid = spec.replica_id
        self.end(rid, gone=False)
        try:
            pub_port, _ = kv_events.ports(spec)
            _, replay = kv_events.endpoints(spec)
        except LlmgwError as exc:
            log.warning("engine %s: no KV events: %s", rid, exc)
            return
        scope, sink = trio.CancelScope(), self.service.sink()
        try:
            stream: Stream = await nursery.start(self._run, scope, sink, rid, pub_port, replay)
        except zmq.ZMQError as exc:
            log.warning("engine %s: its KV events are not received (routers get none): "
                        "127.0.0.1:%d cannot be bound: %s", rid, pub_port, exc)
            self.service.gone(rid)
            return
        except Exception:  # a bug costs this engine's events, never its start
            log.exception("engine %s: its KV-event receiver could not start", rid)
            self.service.gone(rid)
            return
        self._feeds[rid] = (scope, sink)
        for action in stream.engine_started():
            if isinstance(action, Clear):
                sink.clear(rid)

    def end(self, replica: str, *, gone: bool = True) -> None:
        """End `replica`'s receiver (its engine exited or is no longer watched); with
        `gone`, the relay tells its routers so."""
        feed = self._feeds.pop(replica, None)
        if feed is not None:
            scope, sink = feed
            # Closed at once: a batch the receiver already holds, carried out before the
            # cancel reaches it, must not open a life for a replica that has no engine.
            sink.close()
            scope.cancel()
        if gone:
            self.service.gone(replica)

    async def _run(self, scope: trio.CancelScope, sink: RelaySink, rid: str, pub_port: int,
                   replay: str,
                   task_status: trio.TaskStatus[Stream] = trio.TASK_STATUS_IGNORED) -> None:
        assert self.ctx is not None
        started = False

        def bound(stream: Stream) -> None:
            nonlocal started
            started = True
            task_status.started(stream)

        with scope:
            deadline = trio.current_time() + BIND_WAIT
            while True:
                try:
                    await serve_kv_receiver(self.ctx, rid, pub_port, replay,
                                            sink,
                                            task_status=cast("trio.TaskStatus[Stream]", _Started(bound)))
                    return
                except Exception as exc:
                    if started:
                        # A bug costs this engine's events, never the supervisor.
                        log.exception("engine %s: KV-event receiver failed", rid)
                        self.service.gone(rid)
                        return
                    retry = (isinstance(exc, zmq.ZMQError) and exc.errno == zmq.EADDRINUSE
                             and trio.current_time() < deadline)
                    if not retry:
                        raise
                await trio.sleep(_BIND_RETRY)


class _Started:
    """A task_status that calls `on_started`: the retrying task reports itself started
    once, whichever try binds, and knows from then on that a failure is not the bind's."""

    def __init__(self, on_started: Callable[[Stream], None]) -> None:
        self._on_started = on_started

    def started(self, value: Stream) -> None:
        self._on_started(value)

"""The trio shell around one engine's KV-event stream (stream.py): a SUB socket bound on
the loopback port the engine's PUB connects to, a DEALER per replay to the engine's replay
ROUTER, and a sink the stream's actions are carried out on (a KvIndex, for now).

Not yet started by the supervisor: the relay to routers, which would own the sinks, is
still to come. Every frame goes through the total decoder (kvcache/events.py); one that
does not decode costs that message, with a log line, never the receiver.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import trio
import zmq

from llmgw.agent.kvevents.stream import Action, Apply, Clear, Replay, Stream
from llmgw.kvcache.events import (
    MAX_PAYLOAD,
    Batch,
    KvEventError,
    decode_batch,
    is_replay_end,
    replay_frames,
    replay_request,
)
from llmgw.transport.zmqtrio import TrioSocket

log = logging.getLogger(__name__)

# A replay answers from the engine's memory at once; silence this long ends it (the
# stream then goes past what it did not bring, with a clear).
REPLAY_TIMEOUT = 5.0
_MAX_MSG = MAX_PAYLOAD + 4096  # the payload and its topic and seq frames


class Sink(Protocol):
    """What the actions are carried out on: KvIndex's apply and clear."""

    def apply(self, replica: str, batch: Batch) -> Any: ...

    def clear(self, replica: str) -> None: ...


async def serve_kv_receiver(
    ctx: zmq.Context[Any],
    replica: str,
    pub_port: int,
    replay_endpoint: str,
    sink: Sink,
    *,
    stream: Stream | None = None,
    replay_timeout: float = REPLAY_TIMEOUT,
    task_status: trio.TaskStatus[Stream] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Receive `replica`'s engine's batches on tcp://127.0.0.1:`pub_port` until cancelled.
    Started: the port is bound (the engine may start), and the stream is handed back (its
    stats, and engine_started for the supervisor to call)."""
    stream = stream if stream is not None else Stream()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")  # the port is this engine's alone
    sub.setsockopt(zmq.MAXMSGSIZE, _MAX_MSG)
    sub.setsockopt(zmq.LINGER, 0)
    try:
        sub.bind(f"tcp://127.0.0.1:{pub_port}")
    except zmq.ZMQError:
        sub.close()
        raise
    with TrioSocket(sub) as live:
        async with trio.open_nursery() as nursery:
            replays = _Replays(ctx, replica, replay_endpoint, stream, sink, nursery, replay_timeout)
            task_status.started(stream)
            while True:
                frames = await live.recv_multipart()
                batch = _decode(replica, frames)
                if batch is not None:
                    replays.carry_out(stream.live(batch))


def _decode(replica: str, frames: list[bytes]) -> Batch | None:
    try:
        if len(frames) != 3:
            raise KvEventError(f"kv events: a message of {len(frames)} frames, not 3")
        return decode_batch(frames[0], frames[1], frames[2])
    except KvEventError as e:
        log.warning("replica %s: dropped a KV-event message: %s", replica, e)
        return None


class _Replays:
    """Carries out actions; runs the one replay in flight, on its own socket."""

    def __init__(self, ctx: zmq.Context[Any], replica: str, endpoint: str, stream: Stream,
                 sink: Sink, nursery: trio.Nursery, timeout: float) -> None:
        self.ctx, self.replica, self.endpoint = ctx, replica, endpoint
        self.stream, self.sink, self.nursery, self.timeout = stream, sink, nursery, timeout
        self._scope: trio.CancelScope | None = None

    def carry_out(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Apply):
                self.sink.apply(self.replica, a.batch)
            elif isinstance(a, Clear):
                log.info("replica %s: KV index cleared: %s", self.replica, a.reason)
                self.sink.clear(self.replica)
            else:
                self._start(a)

    def _start(self, r: Replay) -> None:
        if self._scope is not None:
            self._scope.cancel()  # a replay no longer wanted: its answers are not read
        scope = self._scope = trio.CancelScope()
        self.nursery.start_soon(self._replay, r, scope)

    async def _replay(self, r: Replay, scope: trio.CancelScope) -> None:
        with scope:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.MAXMSGSIZE, _MAX_MSG)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoint)
            with TrioSocket(sock) as dealer:
                await dealer.send_multipart([b"", replay_request(r.start_seq)])
                while True:
                    frames: list[bytes] | None = None
                    with trio.move_on_after(self.timeout):
                        frames = await dealer.recv_multipart()
                    if frames is None:
                        log.warning("replica %s: the engine's replay from seq %d went silent",
                                    self.replica, r.start_seq)
                        self.carry_out(self.stream.replay_ended(r.ident))
                        return
                    if self._answer(r, frames):
                        return

    def _answer(self, r: Replay, frames: list[bytes]) -> bool:
        """One answer handled; True at the end marker."""
        try:
            topic, seq, payload = replay_frames(frames)
            if is_replay_end(seq):
                self.carry_out(self.stream.replay_ended(r.ident))
                return True
            batch = decode_batch(topic, seq, payload)
        except KvEventError as e:
            log.warning("replica %s: dropped a KV-event replay answer: %s", self.replica, e)
            return False
        self.carry_out(self.stream.replayed(r.ident, batch))
        return False

"""The agent's KV-event receiver (agent/kvevents/receiver.py) on loopback against a fake
engine publisher shaped as vLLM 0.32's ZmqEventPublisher: a PUB that connects to the
agent's port, a ROUTER replaying its buffer from a start seq, then the end marker. The
index follows: a PUB's first batches lost before its connection is up come back by replay,
a batch the live socket lost too, a restart clears, a gap the buffer no longer holds
clears."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import trio
import zmq

from fakes.engines import free_port
from llmgw.agent.kvevents.receiver import serve_kv_receiver
from llmgw.kvcache.events import END_SEQ, Batch
from llmgw.kvcache.index import KvIndex
from llmgw.transport.zmqtrio import TrioSocket

TOPIC = b"tiny-0"


def payload(seq: int, life: int) -> bytes:
    stored = {"type": "BlockStored", "block_hashes": [life * 1000 + seq], "parent_block_hash": None,
              "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": "GPU",
              "lora_name": None}
    return msgpack.packb([float(life), [stored], 0], use_bin_type=True)


class Publisher:
    """One life of a fake engine's publisher: seqs from 0, a buffer of the last `keep`."""

    def __init__(self, ctx: zmq.Context[Any], pub_port: int, replay_port: int, life: int, keep: int) -> None:
        # XPUB: a PUB that also tells the fake when the agent's subscription has arrived.
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.connect(f"tcp://127.0.0.1:{pub_port}")
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        self.pub, self.router = TrioSocket(pub), TrioSocket(router)
        self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
        self.scope = trio.CancelScope()
        self.done = trio.Event()
        self.life, self.keep, self.seq = life, keep, 0
        self.buffer: list[tuple[int, bytes]] = []

    async def subscribed(self) -> None:
        await self.pub.recv_multipart()

    async def publish(self, *, lose: bool = False) -> None:
        body = payload(self.seq, self.life)
        if not lose:
            await self.pub.send_multipart([TOPIC, self.seq.to_bytes(8, "big"), body])
        self.buffer = [*self.buffer, (self.seq, body)][-self.keep:]
        self.seq += 1

    async def serve_replays(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # The last life's listener on this port is closed by ZeroMQ's own thread, a moment
        # after its close(): a restarted engine's bind waits for it the same way.
        with trio.fail_after(10):
            while True:
                try:
                    self.router.sock.bind(self.replay_endpoint)
                    break
                except zmq.ZMQError:
                    await trio.sleep(0.01)
        task_status.started()
        try:
            with self.scope:
                await self._serve()
        finally:
            self.done.set()

    async def _serve(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            for seq, body in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart([ident, b"", TOPIC, seq.to_bytes(8, "big"), body])
            await self.router.send_multipart([ident, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        self.scope.cancel()
        await self.done.wait()  # its replay task off the socket before the socket goes
        self.pub.close()
        self.router.close()


class Recorder:
    """A KvIndex that also keeps what was applied and cleared, and wakes waiters."""

    def __init__(self) -> None:
        self.index = KvIndex("tiny", 10_000)
        self.applied: list[tuple[int, int]] = []  # (life, seq)
        self.clears = 0
        self._changed = trio.Event()

    def apply(self, replica: str, batch: Batch) -> object:
        self.applied.append((int(batch.ts), batch.seq))
        self._wake()
        return self.index.apply(replica, batch)

    def clear(self, replica: str) -> None:
        self.clears += 1
        self.index.clear(replica)
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def until(self, ok: Callable[[], bool]) -> None:
        with trio.fail_after(20):
            while not ok():
                await self._changed.wait()


async def test_the_index_follows_a_lossy_restarting_publisher() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    pub_port, replay_port = free_port(), free_port()
    rec = Recorder()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_kv_receiver, ctx, "tiny-0", pub_port,
                                f"tcp://127.0.0.1:{replay_port}", rec)
            p = Publisher(ctx, pub_port, replay_port, life=0, keep=100)
            await nursery.start(p.serve_replays)
            # What the PUB sends before the agent's subscription reaches it is lost live,
            # and replayed once a later batch shows the gap; seq 6 is lost on the live socket.
            for seq in range(10):
                if seq == 2:
                    await p.subscribed()
                await p.publish(lose=seq == 6)
            await rec.until(lambda: len(rec.applied) == 10)
            assert rec.applied == [(0, s) for s in range(10)] and rec.clears == 0
            assert rec.index.size("tiny-0") == 10
            await p.close()

            # The engine restarts: seqs from 0 again, a new life; the index is cleared.
            p = Publisher(ctx, pub_port, replay_port, life=1, keep=100)
            await nursery.start(p.serve_replays)
            await p.subscribed()
            for _ in range(3):
                await p.publish()
            await rec.until(lambda: (1, 2) in rec.applied)
            assert rec.clears == 1
            assert rec.applied[10:] == [(1, 0), (1, 1), (1, 2)]
            assert rec.index.size("tiny-0") == 3

            # Seqs 3..7 lost live and gone from a buffer of 2: cleared, and on from 8.
            p.keep = 2
            for seq in range(3, 10):
                await p.publish(lose=seq < 8)
            await rec.until(lambda: (1, 9) in rec.applied)
            assert rec.clears == 2
            assert rec.applied[13:] == [(1, 8), (1, 9)]
            assert rec.index.size("tiny-0") == 2
            await p.close()
            nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)

"""Heartbeats, backoff and the ready -> suspect -> lost -> ready walk, on trio's
autojump clock over an in-memory transport (libzmq keeps real time, so not over zmq)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from llmgw import PROTOCOL_VERSION
from llmgw.agent.link import Connection, LinkHooks, LinkSettings, serve_link
from llmgw.backoff import backoff_delay
from llmgw.config.server import ServerConfig
from llmgw.errors import RefusedError
from llmgw.model.inventory import Inventory, NodeInfo
from llmgw.model.node import NodeState
from llmgw.server.peers.service import run_plane
from llmgw.server.peers.sessions import ControlPlane, Outgoing
from llmgw.transport import codec
from llmgw.transport.keys import KeyInfo
from llmgw.transport.messages import DesiredSet, Hello, Message


class MemNetwork:
    """A server transport and a connector for agents; `up` False loses every message."""

    def __init__(self) -> None:
        self.up = True
        self._to_server_send, self._to_server = trio.open_memory_channel[tuple[bytes, str, bytes]](
            math.inf)
        self.peers: dict[bytes, trio.MemorySendChannel[bytes]] = {}
        self.connects: list[float] = []
        self._next = 0

    async def recv_batch(self) -> list[tuple[bytes, str, bytes]]:
        return [await self._to_server.receive()]

    def send_all(self, out: list[Outgoing]) -> None:
        for rid, msg in out:
            ch = self.peers.get(rid)
            if ch is not None and self.up:
                ch.send_nowait(codec.encode(msg))

    def connector(self, uid: str) -> Any:
        net = self

        class Conn:
            def __init__(self, rid: bytes, inbox: trio.MemoryReceiveChannel[bytes]) -> None:
                self.rid, self.inbox = rid, inbox

            async def send(self, payload: bytes) -> None:
                await trio.lowlevel.checkpoint()
                if net.up:
                    net._to_server_send.send_nowait((self.rid, uid, payload))

            async def recv(self) -> bytes:
                return await self.inbox.receive()

        @asynccontextmanager
        async def connect() -> AsyncIterator[Connection]:
            net.connects.append(trio.current_time())
            net._next += 1
            rid = b"r%d" % net._next
            send, recv = trio.open_memory_channel[bytes](math.inf)
            net.peers[rid] = send
            try:
                yield Conn(rid, recv)
            finally:
                del net.peers[rid]

        return connect


def auth(*uids: str) -> dict[str, KeyInfo]:
    """Authorized keys for the in-memory network, whose "key" is the string it is given."""
    return {u: KeyInfo(u.partition(":")[2], u.partition(":")[0], u.encode()) for u in uids}


CONFIG = ServerConfig(heartbeat_interval=5.0, suspect_after_missed=3, lost_after=60.0)
SETTINGS = LinkSettings(heartbeat_interval=5.0, reconnect_base=1.0, reconnect_max=30.0)


def hooks(node_id: str, desired: list[DesiredSet] | None = None) -> LinkHooks:
    async def on_desired(d: DesiredSet) -> None:
        if desired is not None:
            desired.append(d)

    return LinkHooks(
        hello=lambda: Hello(PROTOCOL_VERSION, NodeInfo(node_id, "10.0.0.1"), Inventory()),
        on_desired=on_desired,
    )


def outbox() -> trio.MemoryReceiveChannel[Message]:
    _, recv = trio.open_memory_channel[Message](10)
    return recv


async def test_ready_suspect_lost_ready(autojump_clock: trio.testing.MockClock) -> None:
    net = MemNetwork()
    cp = ControlPlane(config=CONFIG, authorized=auth("node:gpu-a-01"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_plane, cp, net)
        nursery.start_soon(serve_link, SETTINGS, net.connector("node:gpu-a-01"),
                           hooks("gpu-a-01"), outbox())
        await trio.sleep(1)
        assert cp.nodes["gpu-a-01"].state is NodeState.READY
        # Heartbeats keep it ready for as long as they flow.
        await trio.sleep(120)
        assert cp.nodes["gpu-a-01"].state is NodeState.READY

        net.up = False
        t0 = trio.current_time()
        with trio.fail_after(100):
            while cp.nodes["gpu-a-01"].state is NodeState.READY:
                await trio.sleep(0.5)
        silent = trio.current_time() - t0
        # Three missed heartbeats (the last one heard up to one interval before the cut).
        assert 10.0 <= silent <= 17.0
        assert cp.nodes["gpu-a-01"].state is NodeState.SUSPECT
        with trio.fail_after(100):
            while cp.nodes["gpu-a-01"].state is NodeState.SUSPECT:
                await trio.sleep(0.5)
        assert cp.nodes["gpu-a-01"].state is NodeState.LOST
        assert 55.0 <= trio.current_time() - t0 <= 62.0

        net.up = True
        t1 = trio.current_time()
        with trio.fail_after(100):
            while cp.nodes["gpu-a-01"].state is not NodeState.READY:
                await trio.sleep(0.5)
        # Reconnects are spaced by at most reconnect_max plus the Hello timeout.
        assert trio.current_time() - t1 <= 30.0 + 15.0 + 1.0
        nursery.cancel_scope.cancel()


async def test_reconnect_backoff_schedule(autojump_clock: trio.testing.MockClock) -> None:
    net = MemNetwork()
    net.up = False  # no server: every Hello goes unanswered
    with trio.move_on_after(400):
        await serve_link(SETTINGS, net.connector("node:n"), hooks("n"), outbox(), rnd=lambda: 0.0)
    gaps = [b - a for a, b in zip(net.connects, net.connects[1:], strict=False)]
    hello_timeout = 15.0
    waits = [round(g - hello_timeout, 6) for g in gaps]
    # rnd=0 keeps half of each exponential step: 0.5, 1, 2, 4, 8, then capped at 15.
    assert waits[:7] == [0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 15.0]


@pytest.mark.parametrize(
    ("attempt", "rnd", "want"),
    [(0, 0.0, 0.5), (0, 0.999, 0.9995), (3, 0.5, 6.0), (10, 0.0, 15.0), (10, 1.0, 30.0),
     (10_000, 0.5, 22.5)],
)
def test_backoff_delay(attempt: int, rnd: float, want: float) -> None:
    assert backoff_delay(attempt, 1.0, 30.0, rnd) == pytest.approx(want)


def test_backoff_never_exceeds_cap_nor_reaches_zero() -> None:
    for attempt in range(100):
        for rnd in (0.0, 0.3, 0.9999):
            d = backoff_delay(attempt, 0.5, 10.0, rnd)
            assert 0.25 <= d <= 10.0


async def test_refusal_is_final(autojump_clock: trio.testing.MockClock) -> None:
    net = MemNetwork()
    cp = ControlPlane(config=CONFIG, authorized=auth("node:gpu-a-01"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_plane, cp, net)
        with pytest.raises(RefusedError, match="bound to node 'gpu-a-01'"):
            await serve_link(SETTINGS, net.connector("node:gpu-a-01"), hooks("gpu-a-02"), outbox())
        assert len(net.connects) == 1
        assert "gpu-a-02" not in cp.nodes
        nursery.cancel_scope.cancel()


async def test_server_forgets_session_agent_says_hello_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemNetwork()
    cp = ControlPlane(config=CONFIG, authorized=auth("node:gpu-a-01"))
    first = trio.CancelScope()

    async def plane_until_restart() -> None:
        with first:
            await run_plane(cp, net)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(plane_until_restart)
        nursery.start_soon(serve_link, SETTINGS, net.connector("node:gpu-a-01"),
                           hooks("gpu-a-01"), outbox())
        await trio.sleep(1)
        # A server restart with no memory of the session: a new plane on the same network.
        first.cancel()
        cp = ControlPlane(config=CONFIG, authorized=auth("node:gpu-a-01"))
        nursery.start_soon(run_plane, cp, net)
        await trio.sleep(7)
        assert cp.nodes["gpu-a-01"].state is NodeState.READY
        # On the same connection: a new socket would cost the server a second CURVE
        # handshake per agent when a restarted server takes them all back.
        assert len(net.connects) == 1
        nursery.cancel_scope.cancel()


async def test_newest_desired_set_wins(autojump_clock: trio.testing.MockClock) -> None:
    net = MemNetwork()
    got: list[DesiredSet] = []
    cp = ControlPlane(config=CONFIG, authorized=auth("node:n"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_plane, cp, net)
        nursery.start_soon(serve_link, SETTINGS, net.connector("node:n"), hooks("n", got), outbox())
        await trio.sleep(1)
        rid = cp.nodes["n"].routing_id
        net.send_all([(rid, DesiredSet(generation=g)) for g in (1, 2, 3)])
        await trio.sleep(1)
        assert got and got[-1].generation == 3
        nursery.cancel_scope.cancel()

"""The trio adapter over real zmq sockets (real time: libzmq runs its own clock)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import zmq

from llmgw.transport.zmqtrio import TrioSocket


@pytest.fixture
def ctx() -> Any:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


async def test_twenty_dealers_round_trip(ctx: zmq.Context[Any]) -> None:
    router = TrioSocket(ctx.socket(zmq.ROUTER))
    port = router.sock.bind_to_random_port("tcp://127.0.0.1")
    rounds = 50
    got: dict[int, int] = {}

    async def echo() -> None:
        while True:
            rid, payload = await router.recv_multipart()
            await router.send_multipart([rid, payload])

    async def client(i: int) -> None:
        with TrioSocket(ctx.socket(zmq.DEALER)) as d:
            d.sock.connect(f"tcp://127.0.0.1:{port}")
            for n in range(rounds):
                await d.send_multipart([b"%d:%d" % (i, n)])
                (reply,) = await d.recv_multipart()
                assert reply == b"%d:%d" % (i, n)
                got[i] = got.get(i, 0) + 1

    with trio.fail_after(30):
        async with trio.open_nursery() as outer:
            outer.start_soon(echo)
            async with trio.open_nursery() as clients:
                for i in range(20):
                    clients.start_soon(client, i)
            outer.cancel_scope.cancel()
    router.close()
    assert got == {i: rounds for i in range(20)}


async def test_send_waits_at_high_water_mark_without_blocking_trio(ctx: zmq.Context[Any]) -> None:
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 5)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = TrioSocket(ctx.socket(zmq.PUSH))
    push.sock.setsockopt(zmq.SNDHWM, 5)
    push.sock.connect(f"tcp://127.0.0.1:{port}")
    sent = 0
    ticks = 0

    async def sender() -> None:
        nonlocal sent
        for _ in range(100_000):
            await push.send_multipart([b"x" * 1000])
            sent += 1

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await trio.sleep(0.01)
            ticks += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        nursery.start_soon(ticker)
        await trio.sleep(0.5)
        # The sender is parked at the high-water mark, and the loop still runs.
        stuck_at = sent
        assert stuck_at < 100_000
        assert ticks >= 20
        # Draining the receiver lets it go on.
        pull_t = TrioSocket(pull)
        with trio.fail_after(10):
            while sent <= stuck_at + 100:
                await pull_t.recv_multipart()
        nursery.cancel_scope.cancel()
    push.close()
    pull_t.close()


async def test_close_wakes_a_waiting_receiver(ctx: zmq.Context[Any]) -> None:
    sock = TrioSocket(ctx.socket(zmq.DEALER))
    sock.sock.connect("tcp://127.0.0.1:1")
    async with trio.open_nursery() as nursery:

        async def wait_recv() -> None:
            with pytest.raises(trio.ClosedResourceError):
                await sock.recv_multipart()

        nursery.start_soon(wait_recv)
        await trio.sleep(0.05)
        sock.close()


async def test_many_receivers_and_senders_share_one_fd(ctx: zmq.Context[Any]) -> None:
    a = TrioSocket(ctx.socket(zmq.PAIR))
    b = TrioSocket(ctx.socket(zmq.PAIR))
    port = a.sock.bind_to_random_port("tcp://127.0.0.1")
    b.sock.connect(f"tcp://127.0.0.1:{port}")
    received: list[bytes] = []

    async def recv_one() -> None:
        received.append((await a.recv_multipart())[0])

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for _ in range(10):  # ten tasks waiting on one socket: one owns the FD
                nursery.start_soon(recv_one)
            await trio.sleep(0.05)
            for i in range(10):
                await b.send_multipart([b"%d" % i])
    assert sorted(received) == sorted(b"%d" % i for i in range(10))
    a.close()
    b.close()


async def test_try_send_routed(ctx: zmq.Context[Any]) -> None:
    router = TrioSocket(ctx.socket(zmq.ROUTER))
    router.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = router.sock.bind_to_random_port("tcp://127.0.0.1")
    assert router.try_send_routed(b"nobody", b"x") is False
    with TrioSocket(ctx.socket(zmq.DEALER)) as d:
        d.sock.setsockopt(zmq.ROUTING_ID, b"peer")
        d.sock.connect(f"tcp://127.0.0.1:{port}")
        with trio.fail_after(10):
            await d.send_multipart([b"hi"])
            assert await router.recv_multipart() == [b"peer", b"hi"]
            assert router.try_send_routed(b"peer", b"back") is True
            assert await d.recv_multipart() == [b"back"]
    router.close()


async def test_try_send_parts_says_why_not_and_never_waits(ctx: zmq.Context[Any]) -> None:
    router = TrioSocket(ctx.socket(zmq.ROUTER))
    router.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.sock.setsockopt(zmq.SNDHWM, 2)
    port = router.sock.bind_to_random_port("tcp://127.0.0.1")
    assert router.try_send_parts([b"nobody", b"x", b"y"]) == zmq.EHOSTUNREACH
    d = TrioSocket(ctx.socket(zmq.DEALER))
    d.sock.setsockopt(zmq.ROUTING_ID, b"peer")
    d.sock.setsockopt(zmq.RCVHWM, 2)
    d.sock.connect(f"tcp://127.0.0.1:{port}")
    with trio.fail_after(10):
        await d.send_multipart([b"hi"])
        assert await router.recv_multipart() == [b"peer", b"hi"]
        big = b"z" * 100_000  # lent, not copied
        assert router.try_send_parts([b"peer", b"a", big], copy=False) == 0
        assert await d.recv_multipart() == [b"a", big]
        # The peer reads nothing: its queues and the kernel's fill, then the peer's pipe.
        sent = 0
        while (why := router.try_send_parts([b"peer", b"m", big], copy=False)) == 0:
            sent += 1
            assert sent < 10_000
        assert why == zmq.EAGAIN
    d.close()
    router.close()
    assert router.try_send_parts([b"peer", b"late"]) == zmq.ENOTSOCK


async def test_server_batch_drops_a_message_of_many_frames_and_keeps_the_rest(
        ctx: zmq.Context[Any]) -> None:
    from llmgw.server.peers.service import ServerTransport

    router = TrioSocket(ctx.socket(zmq.ROUTER))
    port = router.sock.bind_to_random_port("tcp://127.0.0.1")
    t = ServerTransport(router)
    with TrioSocket(ctx.socket(zmq.DEALER)) as d:
        d.sock.setsockopt(zmq.ROUTING_ID, b"peer")
        d.sock.connect(f"tcp://127.0.0.1:{port}")
        await d.send_multipart([b"one"])
        await d.send_multipart([b"a", b"b", b"c"])
        await d.send_multipart([b"two"])
        got: list[bytes] = []
        with trio.fail_after(10):
            while len(got) < 2:
                got += [payload for rid, uid, payload in await t.recv_batch() if rid == b"peer"]
    assert got == [b"one", b"two"]
    router.close()

"""The agent's KV relay socket (agent/kvevents/relay_serve.py) on loopback with real CURVE
keys: an authorized router's DEALER follows a replica and gets its life and the batches
held, then each batch as it comes; after a batch lost on the way it follows again from
where it is and gets what it lacks; a key the server never authorized is refused at the
handshake (ZAP), and one taken out after it connected is answered no more."""

from __future__ import annotations

import functools
import logging
import random
import socket
from typing import Any

import pytest
import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from fakes.engines import free_port
from llmgw.agent.kvevents.relay import Relay
from llmgw.agent.kvevents.relay_serve import RelayService, keep_kv_relay, serve_kv_relay
from llmgw.agent.kvevents.routers import AuthorizedRouters
from llmgw.kvcache.events import Batch, Stored
from llmgw.kvcache.relay_wire import Follow, Life, Message, RelayBatch, decode, encode
from llmgw.transport.keys import KeyPair
from llmgw.transport.zmqtrio import TrioSocket

R = "tiny-0"


def authorized(*keys: bytes) -> AuthorizedRouters:
    """The router keys the server authorized, as its RouterKeys message hands them on."""
    routers = AuthorizedRouters()
    routers.update([k.decode() for k in keys])
    return routers


def pair() -> KeyPair:
    public, secret = zmq.curve_keypair()
    return KeyPair(public, secret)


def bat(n: int) -> Batch:
    return Batch(float(n), 0, None, (Stored((n,), None, (1, 2), 2),))


def dealer(ctx: zmq.Context[Any], ident: bytes, mine: KeyPair, agent: KeyPair,
           endpoint: str) -> TrioSocket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, ident)
    sock.curve_secretkey, sock.curve_publickey = mine.secret_key, mine.public_key
    sock.curve_serverkey = agent.public_key
    sock.connect(endpoint)
    return TrioSocket(sock)


async def recv(d: TrioSocket) -> Message:
    with trio.fail_after(10):
        return decode(await d.recv_multipart())


def seq_of(m: Message) -> tuple[str, int]:
    assert isinstance(m, Life | RelayBatch)
    return (type(m).__name__, m.seq)


async def test_routers_follow_catch_up_after_a_loss_and_only_authorized_keys_get_answers(
        caplog: pytest.LogCaptureFixture) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    agent, router, stranger = pair(), pair(), pair()
    routers = authorized(router.public_key)
    service = RelayService(Relay(random.Random(5)))
    service.new_life(R)
    for n in range(3):  # before any router follows: held in the ring
        service.batch(R, bat(n))
    life, _ = service.relay.position(R) or (0, 0)
    port = free_port()
    try:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(serve_kv_relay, ctx, service, f"tcp://127.0.0.1:{port}",
                                        agent, routers)
            assert bound == f"tcp://127.0.0.1:{port}"
            with dealer(ctx, b"router-a", router, agent, bound) as a:
                await a.send_multipart(encode(Follow({R: None})))
                got = [await recv(a) for _ in range(4)]
                assert got[0] == Life(R, life, 0)
                assert [seq_of(m) for m in got[1:]] == [("RelayBatch", 0), ("RelayBatch", 1),
                                                        ("RelayBatch", 2)]
                service.batch(R, bat(3))
                assert seq_of(await recv(a)) == ("RelayBatch", 3)

                # Batch 4 is lost on the way (as at a full pipe): 5 shows the gap, and the
                # router follows again from 4.
                service.relay.batch(R, bat(4))
                service.batch(R, bat(5))
                m = await recv(a)
                assert seq_of(m) == ("RelayBatch", 5)
                await a.send_multipart(encode(Follow({R: (life, 4)})))
                assert [seq_of(await recv(a)) for _ in range(2)] == [("RelayBatch", 4),
                                                                     ("RelayBatch", 5)]
                assert service.dropped == 0 and b"router-a" in service.relay.followers()

                # A key the server never authorized: refused at the handshake.
                with dealer(ctx, b"stranger", stranger, agent, bound) as s:
                    mon = s.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
                    with TrioSocket(mon) as events:
                        await s.send_multipart(encode(Follow({R: None})))
                        with trio.fail_after(10):
                            ev = parse_monitor_message(await events.recv_multipart())
                        assert ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                        assert ev["value"] == 400
                    s.sock.disable_monitor()
                assert b"stranger" not in service.relay.followers()

                # The router's key taken out while it is connected: its next Follow is
                # ignored, and it is followed no more.
                routers.update([])
                with caplog.at_level(logging.WARNING, "llmgw.agent.kvevents.relay_serve"):
                    await a.send_multipart(encode(Follow({R: (life, 6)})))
                    with trio.fail_after(10):
                        while "no longer authorized" not in caplog.text:
                            await trio.sleep(0.01)
                assert service.relay.followers() == ()
                assert service.relay.batch(R, bat(6)) == []
            nursery.cancel_scope.cancel()
        assert service.sock is None
    finally:
        ctx.destroy(linger=0)


async def test_a_router_gone_is_forgotten_at_the_next_send_and_bad_frames_cost_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    agent, router = pair(), pair()
    service = RelayService(Relay(random.Random(5)))
    service.new_life(R)
    port = free_port()
    try:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(serve_kv_relay, ctx, service, f"tcp://127.0.0.1:{port}",
                                        agent, authorized(router.public_key))
            with dealer(ctx, b"router-a", router, agent, bound) as a:
                with caplog.at_level(logging.WARNING, "llmgw.agent.kvevents.relay_serve"):
                    await a.send_multipart([b"llmgw-kv/1", b"nonsense"])
                    await a.send_multipart(encode(Life(R, 1, 0)))  # not a router's to send
                    await a.send_multipart(encode(Follow({R: None})))
                    assert isinstance(await recv(a), Life)
                assert caplog.text.count("dropped a message") == 2
            # The DEALER closed: the ROUTER no longer knows its identity.
            with trio.fail_after(10):
                while b"router-a" in service.relay.followers():
                    service.batch(R, bat(1))
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)


async def test_a_relay_port_taken_costs_the_events_until_it_is_free_never_the_agent(
        caplog: pytest.LogCaptureFixture) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    agent, router = pair(), pair()
    service = RelayService(Relay(random.Random(5)))
    service.new_life(R)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    try:
        async with trio.open_nursery() as nursery:
            with caplog.at_level(logging.ERROR, "llmgw.agent.kvevents.relay_serve"):
                await nursery.start(functools.partial(keep_kv_relay, retry=0.05), ctx, service,
                                    f"tcp://127.0.0.1:{port}", agent, authorized(router.public_key))
                with trio.fail_after(10):
                    while "cannot listen on" not in caplog.text:
                        await trio.sleep(0.01)
            assert service.sock is None
            blocker.close()
            with trio.fail_after(10):
                while service.sock is None:
                    await trio.sleep(0.01)
            with dealer(ctx, b"router-a", router, agent, f"tcp://127.0.0.1:{port}") as a:
                await a.send_multipart(encode(Follow({R: None})))
                assert isinstance(await recv(a), Life)
            nursery.cancel_scope.cancel()
    finally:
        blocker.close()
        ctx.destroy(linger=0)


def test_a_send_that_fails_costs_that_message_never_the_caller() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        service = RelayService(Relay(random.Random(5)))
        service.relay.follow(b"router-a", Follow({R: None}), 0.0)
        raw = ctx.socket(zmq.ROUTER)
        service.sock = TrioSocket(raw)
        raw.close()  # under the adapter: each send raises (ENOTSOCK), as at the context's end
        service.new_life(R)  # the supervisor's call, at an engine's start
        service.batch(R, bat(1))
        assert service.dropped == 2 and service.sent == 0
    finally:
        ctx.destroy(linger=0)


def test_a_closed_sink_relays_nothing() -> None:
    """A receiver's sink is closed as its engine ends: a batch it still carries out after
    the relay said Gone opens no life for a replica without an engine."""
    service = RelayService(Relay(random.Random(5)))
    sink = service.sink()
    sink.apply(R, bat(0))  # a batch before any start: a life of its own
    assert service.relay.position(R) is not None
    service.gone(R)
    sink.close()
    sink.apply(R, bat(1))
    sink.clear(R)
    assert service.relay.position(R) is None

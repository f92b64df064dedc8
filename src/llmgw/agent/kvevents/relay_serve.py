"""The trio shell around the KV relay's core (relay.py): the ROUTER socket routers follow
this node's engines' KV-cache events on, and the sink each engine's receiver feeds.

The socket is a CURVE server with the agent's own key pair (the one it dials the server
with), bound on tcp://<mgmt_addr>:<kv_relay_port>. A ZAP handler in the agent's zmq
context admits only the router keys the server has authorized (libzmq admits any CURVE
client when no handler answers, so it is started before the bind), and every Follow is
checked again against the set as it is then: a key taken out stops being answered at its
next message, whatever connection it holds.

Nothing here waits on a router: every send is non-blocking, and one refused (a router at
its high-water mark, or gone) is dropped; the router sees the gap in the seqs and follows
again. Every incoming frame goes through relay_wire.decode: a bad one costs that message
and a throttled log line.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol

import trio
import zmq

from llmgw.agent.kvevents.relay import RING_BATCHES, Out, Relay
from llmgw.kvcache.events import Batch, KvEventError
from llmgw.kvcache.relay_wire import FOLLOW_EVERY, MAX_FOLLOW, Follow, decode
from llmgw.logbound import Throttle, clip
from llmgw.transport.keys import KeyInfo, KeyPair
from llmgw.transport.zap import curve_server, serve_zap
from llmgw.transport.zmqtrio import TrioSocket

log = logging.getLogger(__name__)

# A router's catch-up is up to RING_BATCHES batches of each replica it asks for; a pipe
# that holds two rings' worth takes a usual catch-up whole (more is dropped and asked again).
SNDHWM = 2 * RING_BATCHES
# What a router sends is Follows alone, one per few seconds.
RCVHWM = 1000
# The largest Follow relay_wire reads: MAX_FOLLOW replica ids of up to MAX_TOPIC bytes.
MAX_MSG = MAX_FOLLOW * (1024 + 24) + 1024
ROLE = "router"
_bad = Throttle()  # bad frames, revoked keys and bugs: a line per peer and kind, then fewer


class Routers(Protocol):
    """The router keys the server has authorized, as they are now."""

    def allows(self, public_key_z85: bytes) -> bool: ...


class RelayService:
    """The core and, while serve_kv_relay runs, its socket. The receivers' sinks and the
    supervisor call it on the event loop; what the core returns is sent at once."""

    def __init__(self, relay: Relay, clock: Callable[[], float] = trio.current_time) -> None:
        self.relay = relay
        self.clock = clock
        self.sock: TrioSocket | None = None
        self.sent = 0
        self.dropped = 0  # refused at a router's high-water mark: it follows again

    def sink(self) -> RelaySink:
        return RelaySink(self)

    def batch(self, replica: str, batch: Batch) -> None:
        self.send(self.relay.batch(replica, batch))

    def new_life(self, replica: str) -> None:
        self.send(self.relay.new_life(replica))

    def gone(self, replica: str) -> None:
        self.send(self.relay.gone(replica))

    def follow(self, ident: bytes, msg: Follow) -> None:
        self.send(self.relay.follow(ident, msg, self.clock()))

    def send(self, out: Out) -> None:
        sock = self.sock
        if sock is None:
            return  # no socket (yet): no follower could have asked
        for ident, frames in out:
            try:
                why = sock.try_send_parts([ident, *frames], copy=False)
            except zmq.ZMQError as exc:  # the context ending, say: this message is lost
                _bad.log(log, logging.WARNING, ("send", exc.errno), "KV relay: a send failed: %s",
                         exc)
                why = exc.errno or -1
            if why == 0:
                self.sent += 1
            elif why == zmq.EHOSTUNREACH:
                self.relay.drop(ident)  # its connection is gone: no more sends to it
            else:
                self.dropped += 1


class RelaySink:
    """What one engine's receiver carries its stream's actions out on (receiver.Sink): a
    batch is relayed, a clear (the engine restarted, or its stream broke) begins a life."""

    def __init__(self, service: RelayService) -> None:
        self._service = service
        self.closed = False

    def close(self) -> None:
        """Its receiver is ending: what it still carries out is dropped."""
        self.closed = True

    def apply(self, replica: str, batch: Batch) -> None:
        if self.closed:
            return
        try:
            self._service.batch(replica, batch)
        except Exception:  # a bug costs this batch and the life it was in, not the receiver
            _bad.log(log, logging.ERROR, ("sink", replica), "KV relay: replica %s: a batch "
                     "could not be relayed; a new life begins", replica, exc_info=True)
            self.clear(replica)

    def clear(self, replica: str) -> None:
        if self.closed:
            return
        try:
            self._service.new_life(replica)
        except Exception:
            _bad.log(log, logging.ERROR, ("sink", replica), "KV relay: replica %s: no new "
                     "life", replica, exc_info=True)


def _lookup(routers: Routers, public: bytes) -> KeyInfo | None:
    """zap_reply's lookup: a router key the server authorized, named by itself."""
    return KeyInfo(public.decode(), ROLE, public) if routers.allows(public) else None


async def serve_kv_relay(
    ctx: zmq.Context[Any],
    service: RelayService,
    bind: str,
    pair: KeyPair,
    routers: Routers,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer routers' Follows on `bind` until cancelled. Started: bound; the endpoint.
    Raises zmq.ZMQError when `bind` cannot be bound."""
    refused: zmq.ZMQError | None = None
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_zap, ctx, functools.partial(_lookup, routers))
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # A gone router is told apart (EHOSTUNREACH), and forgotten at once; a full one
        # refuses at the first frame (EAGAIN), never blocks.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MSG)
        # A router whose host vanished is found by the kernel, as the server finds agents.
        curve_server(sock, pair)
        if "[" in bind:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.bind(bind)
        except zmq.ZMQError as exc:
            sock.close()
            refused = exc  # raised below, itself, not inside the nursery's group
            nursery.cancel_scope.cancel()
        else:
            bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            with TrioSocket(sock) as live:
                service.sock = live
                try:
                    nursery.start_soon(_forget, service)
                    log.info("KV relay listening on %s (CURVE, authorized routers)", bound)
                    task_status.started(bound)
                    await _answer(live, service, routers)
                finally:
                    service.sock = None
                    nursery.cancel_scope.cancel()
    if refused is not None:
        raise refused


async def _answer(live: TrioSocket, service: RelayService, routers: Routers) -> None:
    while True:
        frames = await live.recv_frames()
        ident = frames[0].bytes
        try:
            user = str(frames[-1].get("User-Id"))  # the key ZAP admitted the connection with
        except zmq.ZMQError:
            user = ""  # never without the ZAP handler: refused below all the same
        if not routers.allows(user.encode()):
            _bad.log(log, logging.WARNING, ("key", user), "KV relay: ignored a router key "
                     "no longer authorized: %s", user)
            service.relay.drop(ident)
            continue
        try:
            msg = decode([f.bytes for f in frames[1:]])
            if not isinstance(msg, Follow):
                raise KvEventError(f"kv relay: a router sent a {type(msg).__name__}")
        except KvEventError as e:
            _bad.log(log, logging.WARNING, ("bad", user), "KV relay: dropped a message from "
                     "router key %s: %s", user, clip(e, 200))
            continue
        try:
            service.follow(ident, msg)
        except Exception:  # a bug costs this Follow (the router asks again), not the relay
            _bad.log(log, logging.ERROR, ("follow", user), "KV relay: a Follow from router "
                     "key %s failed", user, exc_info=True)
        await trio.lowlevel.checkpoint()  # a catch-up sent: others' turn


async def _forget(service: RelayService) -> None:
    while True:
        await trio.sleep(FOLLOW_EVERY)
        for ident in service.relay.forget(service.clock()):
            log.debug("KV relay: forgot a silent router connection %s", clip(ident, 64))


# Seconds between tries to bind a relay port that was taken.
RETRY_BIND = 30.0


async def keep_kv_relay(
    ctx: zmq.Context[Any],
    service: RelayService,
    bind: str,
    pair: KeyPair,
    routers: Routers,
    *,
    retry: float = RETRY_BIND,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """serve_kv_relay for as long as the agent runs, started at once: a port that cannot be
    bound (or a relay that fails) costs the routers this node's KV events, with an error
    line and another try every `retry` seconds; never the agent, whose engines serve on."""
    task_status.started()
    while True:
        try:
            await serve_kv_relay(ctx, service, bind, pair, routers)
        except zmq.ZMQError as exc:
            log.error("KV relay: cannot listen on %s: %s; routers get no KV events from this "
                      "node until it can (tried again every %gs; kv_relay_port: 0 turns the "
                      "relay off)", bind, exc, retry)
        except Exception:
            log.exception("KV relay failed; started again in %gs", retry)
        await trio.sleep(retry)

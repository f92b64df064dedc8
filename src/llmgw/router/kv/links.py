"""The router's links to the agents' KV-event relays: one DEALER per agent relay the
endpoint table names (a kv_aware model's replica with a `kv` row), a CURVE client with the
router's own key pair and the agent's public key from the row; closed once no row names it.

Each link keeps a `follow.Follower` for the replicas the table places at that agent and
carries out what it says on the model's index (KvRouting). It sends a Follow when the
connection comes up (the socket monitor's handshake event: an agent that restarted, or the
first connect), when the table changes what it follows there, after a gap, and every
FOLLOW_EVERY (the agent forgets a router silent for FORGET_AFTER). A Follow that cannot go
out within FOLLOW_EVERY (the agent is away) is dropped: the next one says the same, newer.

Bounded: a message is at most MAX_MSG bytes (a relayed batch, its frames around it), at
most RCVHWM of them wait in the socket (past that the agent drops what it sends us, and the
seq gap makes us ask again). Frames that do not decode cost themselves, with a throttled
log line; so does a bug in carrying one out.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import trio
import zmq

from llmgw.config.addresses import AddressError, parse_tcp
from llmgw.errors import KeyFileError
from llmgw.kvcache import relay_wire
from llmgw.kvcache.events import MAX_PAYLOAD, KvEventError
from llmgw.logbound import Throttle
from llmgw.router.kv.follow import Apply, Clear, Follower, Outcome
from llmgw.router.kv.policy import KvRouting
from llmgw.transport.keys import KeyPair, load_pair
from llmgw.transport.zmqtrio import TrioSocket

log = logging.getLogger("llmgw.router.kv")

MAX_MSG = MAX_PAYLOAD + 4096  # a batch's payload and the frames around it
# Messages waiting in the socket: batches are one engine scheduler step's events, a few KiB
# mostly; past this the agent's sends to us fail, and we re-follow on the gap.
RCVHWM = 256
SNDHWM = 4  # Follows only: one is enough, a newer one says more


async def serve_kv_links(routing: KvRouting, secret_key_file: str, *,
                         follow_every: float = relay_wire.FOLLOW_EVERY,
                         task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Follow the relays `routing` names, with the router's key pair from
    `secret_key_file`, until cancelled. A key that cannot be read leaves kv_aware models to
    their fallback (logged once): the router serves all the same."""
    try:
        pair = load_pair(secret_key_file)
    except KeyFileError as e:
        log.warning("kv_aware routing follows no KV-event relay: %s", e)
        task_status.started()
        return
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        await KvLinks(routing, ctx, pair, follow_every=follow_every).serve(task_status=task_status)
    finally:
        ctx.destroy(linger=0)


class KvLinks:
    """The links of one router, following `routing.agents`."""

    def __init__(self, routing: KvRouting, ctx: zmq.Context[Any], pair: KeyPair, *,
                 follow_every: float = relay_wire.FOLLOW_EVERY) -> None:
        self.routing = routing
        self.ctx = ctx
        self.pair = pair
        self.follow_every = follow_every
        self.links: dict[tuple[str, str], _Link] = {}
        self.log = Throttle(burst=5, period=60.0, clock=time.monotonic)

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                changed = self.routing.changed
                self._reconcile(nursery)
                await changed.wait()

    def _reconcile(self, nursery: trio.Nursery) -> None:
        want = self.routing.agents
        for agent in [a for a in self.links if a not in want]:
            link = self.links.pop(agent)
            link.scope.cancel()
            link.carry(link.follower.want(()))  # its replicas: cleared
            log.info("kv relay %s: no longer followed", agent[0])
        for agent, replicas in want.items():
            found = self.links.get(agent)
            if found is None:
                found = self.links[agent] = _Link(self, agent[0], agent[1])
                nursery.start_soon(found.run)
                log.info("kv relay %s: following %d replicas", agent[0], len(replicas))
            found.carry(found.follower.want(replicas))


class _Link:
    def __init__(self, owner: KvLinks, endpoint: str, agent_key: str) -> None:
        self.owner = owner
        self.endpoint = endpoint
        self.agent_key = agent_key
        self.follower = Follower()
        self.scope = trio.CancelScope()
        self.poke = trio.Event()  # set: send a Follow now

    # ---- what the follower says -------------------------------------------------------

    def carry(self, out: Outcome, replica: str = "") -> None:
        """Carry out `out` on the index (`replica`: the one the message named)."""
        routing = self.owner.routing
        for a in out.actions:
            km = routing.model_of(a.replica)
            if km is None:
                continue  # no longer a kv_aware replica: its index entry went with the table
            if isinstance(a, Clear):
                km.index.clear(a.replica)
                km.clears[a.why] = km.clears.get(a.why, 0) + 1
            elif isinstance(a, Apply):
                applied = km.index.apply(a.replica, a.batch)
                km.batches += 1
                km.stored += applied.stored
                km.removed += applied.removed
                km.orphans += applied.orphans
        if out.follow:
            if out.dropped == "gap":
                km = routing.model_of(replica)
                if km is not None:
                    km.refollows += 1
            self.poke.set()

    # ---- the socket ---------------------------------------------------------------------

    async def run(self) -> None:
        with self.scope:
            try:
                await self._run()
            except Exception:  # a bug of ours, or zmq's surprise: this link, never the router
                self.owner.log.bug(log, ("link", self.endpoint),
                                   "kv relay %s: the link ended", self.endpoint)

    async def _run(self) -> None:
        sock = self._socket()
        if sock is None:
            return
        with TrioSocket(sock) as ts, TrioSocket(
                sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)) as monitor:
            try:
                sock.connect(self.endpoint)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._read, ts)
                    nursery.start_soon(self._connects, monitor)
                    await self._write(ts)
            finally:
                try:
                    sock.disable_monitor()
                except zmq.ZMQError:
                    pass  # closed already: nothing left to stop

    def _socket(self) -> zmq.Socket[Any] | None:
        """The DEALER, or None (logged) when the row's address or key cannot be used."""
        try:
            parse_tcp(self.endpoint)
        except AddressError as e:
            self.owner.log.log(log, logging.WARNING, ("address", self.endpoint),
                               "kv relay %s: not followed: %s", self.endpoint, e)
            return None
        sock = self.owner.ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # a Follow waits for a connection, not in a queue
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MSG)
            sock.setsockopt(zmq.RCVHWM, RCVHWM)
            sock.setsockopt(zmq.SNDHWM, SNDHWM)
            sock.setsockopt(zmq.RECONNECT_IVL, 200)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
            sock.curve_secretkey = self.owner.pair.secret_key
            sock.curve_publickey = self.owner.pair.public_key
            sock.curve_serverkey = self.agent_key.encode("ascii")
        except (zmq.ZMQError, ValueError, UnicodeEncodeError) as e:
            sock.close()
            self.owner.log.log(log, logging.WARNING, ("key", self.endpoint),
                               "kv relay %s: not followed: the agent's key is not a CURVE public key (%s)",
                               self.endpoint, e)
            return None
        return sock

    async def _write(self, ts: TrioSocket) -> None:
        every = self.owner.follow_every
        beat = trio.current_time() + every
        while True:
            with trio.move_on_at(beat):
                await self.poke.wait()
            if trio.current_time() >= beat:
                beat = trio.current_time() + every
            self.poke = trio.Event()
            frames = relay_wire.encode(self.follower.follow_message())
            with trio.move_on_after(every):
                await ts.send_multipart(frames)

    async def _connects(self, monitor: TrioSocket) -> None:
        while True:
            await monitor.recv_multipart()  # a handshake done: the agent may not know us
            self.poke.set()

    async def _read(self, ts: TrioSocket) -> None:
        while True:
            frames = await ts.recv_multipart()
            try:
                msg = relay_wire.decode(frames)
            except KvEventError as e:
                self.owner.log.log(log, logging.WARNING, ("frames", self.endpoint),
                                   "kv relay %s: dropped a message: %s", self.endpoint, e)
                continue
            try:
                self.carry(self.follower.receive(msg), getattr(msg, "replica", ""))
            except Exception:  # a bug of ours costs this message, never the link
                self.owner.log.bug(log, ("bug", self.endpoint),
                                   "kv relay %s: a message not carried out", self.endpoint)

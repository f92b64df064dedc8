"""Several servers on one PostgreSQL database, one of them the leader.

Leadership is a lease row (migration 2), not an advisory lock, because the issue asks
that a leader cut off from its database stop acting *before* another can take over. An
advisory lock is released when PostgreSQL notices the session is gone, which is whenever
TCP gives up, and the holder cannot learn when that was. A lease is judged by one clock,
the database's: the leader renews every lease/3 and counts its lease from the moment it
*sent* the renewal (that can only be earlier than the database's own stamp), less a
margin, so it steps down locally while the row still says it leads; a standby takes over
only once the row has expired by the database's clock. Every write checks the epoch in
its own transaction (store_pg.py), so even a leader paused past its lease (SIGSTOP, a
long GC, a VM migration) cannot overwrite its successor when it wakes.

A term: won the lease -> `serve_server` on the shared, fenced store, with a fresh control
plane loaded from the database -> lost it (lease not renewed in time, a write refused, the
database gone under a pass) -> the term is cancelled, nothing in memory survives it, and
the server is a standby again. A standby binds the same address and answers every message
with NotLeader naming the leader, so agents, routers and ctl move there (follow.py).
"""

from __future__ import annotations

import functools
import logging
import uuid
from pathlib import Path
from typing import Any

import trio
import zmq

from llmgw.config.server import ServerConfig
from llmgw.errors import LlmgwError, ProtocolError
from llmgw.logbound import Throttle
from llmgw.server.control import Outgoing
from llmgw.server.service import KeyWatcher, ServerTransport, serve_server
from llmgw.server.store import StoreError
from llmgw.server.store_pg import PgLease, PgStore
from llmgw.transport import codec
from llmgw.transport.keys import load_pair
from llmgw.transport.messages import NotLeader, Request
from llmgw.transport.zap import serve_zap
from llmgw.transport.zmqtrio import TrioSocket

log = logging.getLogger(__name__)

MARGIN = 0.2  # share of the lease a leader gives up early, for clock-rate drift and scheduling
BIND_TRIES = 50  # the previous term's socket may still hold the port for a moment


def advertised(config: ServerConfig) -> str:
    return config.advertise or config.bind


class LeaseKeeper:
    """Win, hold and lose the lease. Blocking calls run in threads that a lost lease
    abandons: a database that hangs cannot hold up stepping down."""

    def __init__(self, lease: PgLease, address: str, ttl: float) -> None:
        self.lease = lease
        self.holder = uuid.uuid4().hex  # this process, this run
        self.address = address
        self.ttl = ttl
        self.leader = ""  # the leader's address as last read ("" unknown, or none)
        self._throttle = Throttle()

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)

    async def elected(self) -> tuple[int, float]:
        """Wait until this server holds the lease: (epoch, monotonic time it is valid until)."""
        while True:
            sent = trio.current_time()
            try:
                epoch = await self._call(self.lease.acquire, self.holder, self.address, self.ttl)
                if epoch is not None:
                    self.leader = self.address
                    return epoch, sent + self.ttl * (1 - MARGIN)
                _epoch, _holder, address, live = await self._call(self.lease.current)
                self.leader = address if live else ""
            except StoreError as exc:
                self.leader = ""
                self._throttle.log(log, logging.WARNING, "db", "standby: cannot reach the database: %s",
                                   exc)
            await trio.sleep(min(1.0, self.ttl / 4))

    async def hold(self, epoch: int, valid_until: float) -> str:
        """Renew until the lease is lost; returns why. The cancel scope's deadline is the
        lease as this server counts it: a renewal that hangs cannot stretch it."""
        why = "the lease ran out before it could be renewed"
        with trio.CancelScope(deadline=valid_until) as scope:
            while True:
                await trio.sleep(self.ttl / 3)
                sent = trio.current_time()
                try:
                    ok = await self._call(self.lease.renew, epoch, self.holder, self.ttl)
                except StoreError as exc:
                    log.warning("cannot renew the leader lease: %s", exc)
                    continue
                if not ok:
                    why = "the lease is no longer ours (another server leads)"
                    break
                scope.deadline = sent + self.ttl * (1 - MARGIN)
        return why

    async def release(self, epoch: int) -> None:
        with trio.move_on_after(2):
            try:
                await self._call(self.lease.release, epoch, self.holder)
            except StoreError as exc:
                log.warning("could not release the leader lease (it runs out by itself): %s", exc)


async def serve_standby(config: ServerConfig, keeper: LeaseKeeper, *,
                        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer every message with NotLeader until cancelled (the server won the lease)."""
    keys_dir = Path(config.keys_dir)
    pair = load_pair(str(keys_dir / "server.key_secret"))
    watcher = KeyWatcher(keys_dir / "authorized")
    watcher.reload_if_changed(force=True)
    ctx: zmq.Context[Any] = zmq.Context()
    sock = None
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_zap, ctx, watcher.lookup)
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_size)
            sock.curve_server = True
            sock.curve_secretkey = pair.secret_key
            sock.curve_publickey = pair.public_key
            sock.zap_domain = b"llmgw"
            await bind_retrying(sock, config.bind)
            t = ServerTransport(TrioSocket(sock))
            log.info("standby on %s; the leader is %s", config.bind, keeper.leader or "not known yet")
            task_status.started(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            while True:
                batch = await t.recv_batch()
                watcher.reload_if_changed()  # a stat of the folder: standbys see little traffic
                out: list[Outgoing] = []
                for rid, _uid, payload in batch:
                    try:
                        msg = codec.decode(payload)
                    except ProtocolError:
                        continue
                    request_id = msg.request_id if isinstance(msg, Request) else ""
                    out.append((rid, NotLeader(keeper.leader, request_id)))
                t.send_all(out)
    finally:
        if sock is not None:
            sock.close(linger=0)
        ctx.term()


async def bind_retrying(sock: zmq.Socket[Any], address: str) -> None:
    for attempt in range(BIND_TRIES):
        try:
            sock.bind(address)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or attempt == BIND_TRIES - 1:
                raise LlmgwError(f"cannot bind {address}: {exc}") from None
            await trio.sleep(0.1)


async def serve_replicated(config: ServerConfig, *,
                           task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """`llmgw server` on PostgreSQL: standby until this server wins the lease, leader for
    as long as it holds it, standby again after."""
    store = await trio.to_thread.run_sync(PgStore.from_config, config.store)
    lease = store.lease_connection()
    keeper = LeaseKeeper(lease, advertised(config), config.store.lease)
    started = False
    try:
        while True:
            async with trio.open_nursery() as standby:
                bound = await standby.start(serve_standby, config, keeper)
                if not started:
                    task_status.started(bound)
                    started = True
                epoch, valid_until = await keeper.elected()
                standby.cancel_scope.cancel()
            store.fence, store.fenced = (epoch, keeper.holder), False
            log.warning("leading with epoch %d (lease %gs)", epoch, keeper.ttl)
            why = await _term(config, store, keeper, epoch, valid_until)
            log.warning("stepped down from epoch %d: %s; standby now", epoch, why)
    finally:
        with trio.CancelScope(shield=True):
            if store.fence is not None:
                await keeper.release(store.fence[0])
        lease.close()
        store.close()


async def _term(config: ServerConfig, store: PgStore, keeper: LeaseKeeper, epoch: int,
                valid_until: float) -> str:
    why = ["cancelled"]
    try:
        async with trio.open_nursery() as nursery:

            async def keep() -> None:
                why[0] = await keeper.hold(epoch, valid_until)
                nursery.cancel_scope.cancel()

            async def fence_watch() -> None:
                # Set by the store's worker threads, which cannot set a trio.Event.
                while not store.fenced:  # noqa: ASYNC110
                    await trio.sleep(0.2)
                why[0] = "a write was refused by the epoch check (another server leads)"
                nursery.cancel_scope.cancel()

            nursery.start_soon(keep)
            nursery.start_soon(fence_watch)
            # The standby's socket is closed (its context terminated): the port is free.
            await nursery.start(functools.partial(serve_server, config, store=store))
    except* StoreError as group:
        why[0] = f"the store failed under this term: {group.exceptions[0]}"
    store.fence = None  # nothing more is written with this epoch
    return why[0]


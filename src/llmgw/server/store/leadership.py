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
long GC, a VM migration) cannot overwrite its successor when it wakes. The check takes
no lock: a takeover waits on nothing the old leader holds; the new leader ends the old
epoch's sessions (rolling back what they had open) before its term starts.

The lease is renewed on a connection of its own, through threads of its own (a trio
CapacityLimiter apart from the one the store's calls share), so a leader busy writing
does not lose its term waiting for a thread.

A term: won the lease -> `serve_server` on the shared, fenced store, with a fresh control
plane loaded from the database -> lost it (lease not renewed in time, a write refused, the
database gone under a pass) -> the term is cancelled, nothing in memory survives it, and
the server is a standby again. A standby binds the same address and answers every message
with NotLeader naming the leader (never itself), so agents, routers and ctl move there
(follow.py). A leader stepping down answers the requests it had taken with NotLeader too.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
import zmq

from llmgw.config.server import ServerConfig
from llmgw.errors import LlmgwError, ProtocolError
from llmgw.logbound import Throttle
from llmgw.server.peers.service import KeyWatcher, ServerTransport, serve_server
from llmgw.server.peers.sessions import Outgoing
from llmgw.server.store.postgres import PgLease, PgStore
from llmgw.server.store.sql import StoreError
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
        self.leader = ""  # the leader's address as last read ("" unknown, none, or this one)
        self._throttle = Throttle()
        # Threads of its own: the store's calls (trio's default limiter, 40 threads) can all
        # be waiting for the database at once, and a renewal must not queue behind them.
        self._limiter = trio.CapacityLimiter(4)

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True,
                                             limiter=self._limiter)

    def other(self, address: str, holder: str, live: bool) -> str:
        """The leader to name to others: a live row's address, unless the row is ours (a
        server that stepped down early, on its own clock, while the row still names it)."""
        return address if live and holder != self.holder and address != self.address else ""

    async def learn_leader(self, timeout: float = 0.5) -> None:
        """Read who leads now, briefly (a server stepping down names its successor)."""
        self.leader = ""
        with trio.move_on_after(timeout):
            try:
                _epoch, holder, address, live = await self._call(self.lease.current)
                self.leader = self.other(address, holder, live)
            except StoreError as exc:
                log.info("cannot tell who leads now: %s", exc)

    async def elected(self) -> tuple[int, float]:
        """Wait until this server holds the lease: (epoch, monotonic time it is valid until)."""
        while True:
            sent = trio.current_time()
            try:
                epoch = await self._call(self.lease.acquire, self.holder, self.address, self.ttl)
                if epoch is not None:
                    if await self._end_old_term(epoch):
                        self.leader = ""
                        return epoch, sent + self.ttl * (1 - MARGIN)
                else:
                    _epoch, holder, address, live = await self._call(self.lease.current)
                    self.leader = self.other(address, holder, live)
            except StoreError as exc:
                self.leader = ""
                self._throttle.log(log, logging.WARNING, "db", "standby: cannot reach the database: %s",
                                   exc)
            await trio.sleep(min(1.0, self.ttl / 4))

    async def _end_old_term(self, epoch: int) -> bool:
        """Won `epoch`: end the sessions of the term before it, so that nothing the old
        leader holds (a frozen process inside a write) outlives this takeover. False (the
        lease given back) when that cannot be done in time."""
        sent = trio.current_time()
        try:
            ended = await self._call(self.lease.end_term, epoch - 1, self.ttl / 2)
        except StoreError as exc:
            log.warning("won epoch %d but the sessions of epoch %d are still open: %s; "
                        "giving the lease back", epoch, epoch - 1, exc)
            await self.release(epoch)
            return False
        if ended:
            log.warning("ended %d database session(s) of epoch %d (%.2fs)", ended, epoch - 1,
                        trio.current_time() - sent)
        return True

    async def hold(self, epoch: int, valid_until: float) -> str:
        """Renew until the lease is lost; returns why. The cancel scope's deadline is the
        lease as this server counts it: a renewal that hangs cannot stretch it."""
        renewed = trio.current_time()
        last_error = ""
        in_flight: float | None = None
        with trio.CancelScope(deadline=valid_until) as scope:
            while True:
                await trio.sleep(self.ttl / 3)
                sent = in_flight = trio.current_time()
                try:
                    ok = await self._call(self.lease.renew, epoch, self.holder, self.ttl)
                except StoreError as exc:
                    last_error = str(exc)
                    log.warning("cannot renew the leader lease: %s", exc)
                    continue
                finally:
                    in_flight = None
                if not ok:
                    return "the lease is no longer ours (another server leads)"
                renewed, last_error = sent, ""
                scope.deadline = sent + self.ttl * (1 - MARGIN)
        now = trio.current_time()
        if in_flight is not None:
            detail = f"a renewal sent {now - in_flight:.1f}s ago has had no answer"
        elif last_error:
            detail = f"the last renewal failed: {last_error}"
        else:
            detail = "no renewal could run: this process was paused or starved"
        return (f"the lease ran out before it could be renewed (last renewed {now - renewed:.1f}s "
                f"ago; {detail})")

    def named(self) -> str:
        """The leader's address for NotLeader: never this server's own."""
        return self.leader if self.leader != self.address else ""

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
            log.info("standby on %s; the leader is %s", config.bind,
                     keeper.named() or "not known yet")
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
                    out.append((rid, NotLeader(keeper.named(), request_id)))
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
            if not keeper.leader:
                await keeper.learn_leader()
    finally:
        with trio.CancelScope(shield=True):
            if store.fence is not None:
                await keeper.release(store.fence[0])
        lease.close()
        store.close()


def reason(exc: BaseException) -> str:
    """What happened, in words: the first error inside however many exception groups (a
    nursery wraps what its tasks raised; the wrapper's own text says nothing)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if not isinstance(exc, LlmgwError) or not text else text


async def _term(config: ServerConfig, store: PgStore, keeper: LeaseKeeper, epoch: int,
                valid_until: float) -> str:
    why = ["cancelled"]

    def end(cancel: Callable[[], None], because: str) -> None:
        why[0] = because
        # A store call blocked on a database that no longer answers (a silent network)
        # would hold the term open: its socket is shut down, the call returns an error.
        store.abort()
        cancel()

    try:
        async with trio.open_nursery() as nursery:

            async def keep() -> None:
                because = await keeper.hold(epoch, valid_until)
                if "no longer ours" in because:
                    await keeper.learn_leader()
                end(nursery.cancel_scope.cancel, because)

            async def fence_watch() -> None:
                # Set by the store's worker threads, which cannot set a trio.Event.
                while not store.fenced:  # noqa: ASYNC110
                    await trio.sleep(0.2)
                keeper.leader = keeper.other(store.fenced_leader, "", bool(store.fenced_leader))
                end(nursery.cancel_scope.cancel,
                    f"a write was refused by the epoch check (another server leads): "
                    f"{store.fenced_why}")

            nursery.start_soon(keep)
            nursery.start_soon(fence_watch)
            # The standby's socket is closed (its context terminated): the port is free.
            # Requests still pending when the term ends are answered NotLeader, naming
            # the successor when it is known by then.
            await nursery.start(functools.partial(serve_server, config, store=store,
                                                  not_leader=keeper.named))
    except* StoreError as group:
        why[0] = f"the store failed under this term: {reason(group)}"
    store.fence = None  # nothing more is written with this epoch
    return why[0]

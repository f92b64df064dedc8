"""The agent's session with the server: Hello, heartbeats, reconnects, and the messages
the server sends (desired sets, log requests, rediscovery, the router keys).

The transport is injected (`connect`), so the same code runs over CURVE sockets and over
the in-memory channels the timing tests use with trio's autojump clock.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import trio
from attrs import define

from llmgw.backoff import backoff_delay
from llmgw.errors import ProtocolError, RefusedError
from llmgw.transport import codec
from llmgw.transport.messages import (
    ClearGpu,
    DesiredSet,
    Heartbeat,
    HeartbeatAck,
    Hello,
    HelloFirst,
    LogsReply,
    LogsRequest,
    Message,
    NotLeader,
    Rediscover,
    Refused,
    RouterKeys,
    Welcome,
)

log = logging.getLogger(__name__)

MISSED_BEFORE_LOST = 3  # heartbeat intervals of server silence before we reconnect


class Connection(Protocol):
    async def send(self, payload: bytes) -> None: ...
    async def recv(self) -> bytes: ...


Connector = Callable[[], AbstractAsyncContextManager[Connection]]


@define
class LinkHooks:
    hello: Callable[[], Hello]
    on_desired: Callable[[DesiredSet], Awaitable[None]]
    on_rediscover: Callable[[], None] = lambda: None
    # The operator's `ctl gpu clear`: GPU UUIDs whose Xid problems to forget.
    on_clear_gpu: Callable[[tuple[str, ...]], None] = lambda gpus: None
    logs: Callable[[str, int], tuple[str, ...]] = lambda replica, n: ()
    on_connected: Callable[[], None] = lambda: None
    # A standby answered: the leader's address ("" while none is known). The connector
    # picks where to go next (llmgw.transport.follow.Follower).
    on_not_leader: Callable[[str], None] = lambda leader: None
    # The router keys the server authorizes now (RouterKeys): who may follow this node's
    # KV events on its relay (agent/kvevents/routers.py's AuthorizedRouters.update).
    on_router_keys: Callable[[tuple[str, ...]], None] = lambda keys: None


class _Lost(Exception):
    """The session ended without a refusal: reconnect."""


class _HelloAgain(Exception):
    """The server has no session for us (it restarted): Hello again on this connection.

    The connection itself is fine (libzmq has already reconnected it, with a new CURVE
    handshake): a new socket would cost the server a second handshake per agent, which
    was half its CPU when ten thousand agents came back at once (bench/README.md)."""


@define
class LinkSettings:
    heartbeat_interval: float
    reconnect_base: float
    reconnect_max: float


async def serve_link(
    settings: LinkSettings,
    connect: Connector,
    hooks: LinkHooks,
    outbox: trio.MemoryReceiveChannel[Message],
    *,
    rnd: Callable[[], float] = random.random,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep a session up until cancelled; raise RefusedError when the server refuses us."""
    task_status.started()
    attempt = 0
    reached = False
    while True:
        try:
            async with connect() as conn:
                while True:
                    await _handshake(conn, hooks, settings)
                    attempt = 0
                    reached = True
                    hooks.on_connected()
                    try:
                        await _session(conn, hooks, settings, outbox)
                    except _HelloAgain as exc:
                        log.warning("%s", exc)
                    # Jittered as a reconnect is, so that the agents of a restarted
                    # server do not all say Hello in the same instant.
                    delay = backoff_delay(attempt, settings.reconnect_base, settings.reconnect_max, rnd())
                    attempt += 1
                    log.info("saying Hello again in %.1fs", delay)
                    await trio.sleep(delay)
        except _Lost as exc:
            if reached:
                log.warning("lost the server: %s", exc)
            else:
                log.warning("has not reached the server yet: %s", exc)
        delay = backoff_delay(attempt, settings.reconnect_base, settings.reconnect_max, rnd())
        attempt += 1
        log.info("reconnecting in %.1fs (attempt %d)", delay, attempt)
        await trio.sleep(delay)


async def _recv(conn: Connection) -> Message:
    while True:
        try:
            return codec.decode(await conn.recv())
        except ProtocolError as exc:
            log.warning("ignored a bad message from the server: %s", exc)


async def _handshake(conn: Connection, hooks: LinkHooks, settings: LinkSettings) -> None:
    timeout = max(settings.heartbeat_interval * MISSED_BEFORE_LOST, 1.0)
    started = trio.current_time()
    welcomed, failure = False, None
    with trio.move_on_after(timeout):
        async with trio.open_nursery() as nursery:
            # Where nothing listens (the server died; after a failover the leader is at
            # another address) the Hello is given up in under a second, not after the
            # whole bound: the connector moves on, and agents find the new leader sooner.
            nursery.start_soon(_give_up_where_nothing_listens, conn, nursery.cancel_scope)
            try:
                await _hello(conn, hooks)
                welcomed = True
            except (_Lost, RefusedError) as exc:
                failure = exc  # raised below, not wrapped in the nursery's exception group
            nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure
    if welcomed:
        return
    # A socket transport can say why (nothing listens, our key refused...); the
    # in-memory transports of the timing tests have no handshake to explain.
    waited = trio.current_time() - started
    explain = getattr(conn, "explain_silence", None)
    raise _Lost(explain(waited) if explain else f"no answer to Hello within {waited:g}s")


async def _hello(conn: Connection, hooks: LinkHooks) -> None:
    # With no connection up, the send itself waits: it shares the bound.
    await conn.send(codec.encode(hooks.hello()))
    while True:
        msg = await _recv(conn)
        if isinstance(msg, Refused):
            raise RefusedError(f"the server refused this agent: {msg.reason}")
        if isinstance(msg, Welcome):
            log.info("connected to the server as %s", msg.node_id)
            return
        if isinstance(msg, NotLeader):
            _not_leader(hooks, msg)
        log.debug("ignored %s before Welcome", codec.kind_of(msg))


async def _give_up_where_nothing_listens(conn: Connection, scope: trio.CancelScope) -> None:
    monitor = getattr(conn, "monitor", None)  # the CURVE DEALER's (transport/dealer.py)
    if monitor is None:  # the in-memory transports of the timing tests
        return
    await monitor.until_nothing_listens()
    scope.cancel()


def _not_leader(hooks: LinkHooks, msg: NotLeader) -> None:
    hooks.on_not_leader(msg.leader)
    raise _Lost(f"that server is a standby; the leader is {msg.leader or 'not known yet'}")


def _leaf(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one llmgw exception that ended a session's nursery, if that is what happened."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found = _leaf(exc)
            if found is not None:
                return found
        elif isinstance(exc, RefusedError | _Lost | _HelloAgain):
            return exc
    return None


async def _session(
    conn: Connection,
    hooks: LinkHooks,
    settings: LinkSettings,
    outbox: trio.MemoryReceiveChannel[Message],
) -> None:
    try:
        async with trio.open_nursery() as nursery:
            await _Session(conn, hooks, settings, outbox).run(nursery)
    except BaseExceptionGroup as group:
        leaf = _leaf(group)
        if leaf is not None:
            raise leaf from None
        raise


class _Session:
    def __init__(
        self,
        conn: Connection,
        hooks: LinkHooks,
        settings: LinkSettings,
        outbox: trio.MemoryReceiveChannel[Message],
    ) -> None:
        self.conn = conn
        self.hooks = hooks
        self.interval = settings.heartbeat_interval
        self.outbox = outbox
        self.last_heard = trio.current_time()
        self.desired: DesiredSet | None = None
        self.desired_ready = trio.Event()

    async def run(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self.heartbeats)
        nursery.start_soon(self.forward)
        nursery.start_soon(self.apply_desired)
        while True:
            msg = await _recv(self.conn)
            self.last_heard = trio.current_time()
            await self.dispatch(msg)

    async def dispatch(self, msg: Message) -> None:
        if isinstance(msg, HeartbeatAck | Welcome):
            return
        if isinstance(msg, DesiredSet):
            self.desired = msg
            self.desired_ready.set()
        elif isinstance(msg, Refused):
            raise RefusedError(f"the server refused this agent: {msg.reason}")
        elif isinstance(msg, HelloFirst):
            raise _HelloAgain(f"the server asked for a new Hello ({msg.reason})")
        elif isinstance(msg, NotLeader):
            _not_leader(self.hooks, msg)
        elif isinstance(msg, Rediscover):
            self.hooks.on_rediscover()
        elif isinstance(msg, ClearGpu):
            self.hooks.on_clear_gpu(msg.gpus)
        elif isinstance(msg, RouterKeys):
            self.hooks.on_router_keys(msg.keys)
        elif isinstance(msg, LogsRequest):
            lines = self.hooks.logs(msg.replica_id, msg.lines)
            await self.conn.send(codec.encode(LogsReply(msg.request_id, msg.replica_id, lines)))
        else:
            log.warning("ignored %s: not a message the server sends", codec.kind_of(msg))

    async def heartbeats(self) -> None:
        seq = 0
        while True:
            await trio.sleep(self.interval)
            if trio.current_time() - self.last_heard > self.interval * MISSED_BEFORE_LOST:
                raise _Lost(f"no word from the server for {MISSED_BEFORE_LOST} heartbeats")
            seq += 1
            with trio.move_on_after(self.interval):
                await self.conn.send(codec.encode(Heartbeat(seq=seq)))

    async def forward(self) -> None:
        async for msg in self.outbox:
            await self.conn.send(codec.encode(msg))

    async def apply_desired(self) -> None:
        # Level-triggered: only the newest desired set matters, and a slow convergence
        # never holds up heartbeats or the receiving of newer sets.
        while True:
            await self.desired_ready.wait()
            self.desired_ready = trio.Event()
            latest, self.desired = self.desired, None
            if latest is not None:
                await self.hooks.on_desired(latest)

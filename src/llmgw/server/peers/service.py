"""The server's trio shell: ZAP, the ROUTER socket, timers and key reloads around the
sans-IO ControlPlane."""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import trio
import zmq

from llmgw.config.server import ServerConfig
from llmgw.errors import InternalError, ListenError, LlmgwError
from llmgw.logbound import Throttle, clip
from llmgw.server.cluster import Cluster
from llmgw.server.gpu_clear import GpuClear
from llmgw.server.metrics import ServerMetrics
from llmgw.server.ops import Ops
from llmgw.server.orchestrator import Orchestrator
from llmgw.server.peers.sessions import ControlPlane, Outgoing
from llmgw.server.store.open import open_store
from llmgw.server.store.sql import FencedError, StateStore
from llmgw.server.web import serve_server_http
from llmgw.transport import codec
from llmgw.transport.keys import KeyInfo, load_authorized, load_pair
from llmgw.transport.messages import NotLeader, Reply, Request
from llmgw.transport.zap import curve_server, serve_zap, user_id
from llmgw.transport.zmqtrio import TrioSocket

log = logging.getLogger(__name__)

# Seconds between applications of silence to nodes, and checks of the authorized folder.
TICK_INTERVAL = 1.0
BATCH = 256  # messages handled per trip through the scheduler
# After a batch that did not fill, the loop lets messages gather this long before it
# takes the next: one wake-up (and one ZMQ_EVENTS round) per batch instead of one per
# message, and the acknowledgements of a batch go to libzmq's I/O thread together. What
# it costs: this much more latency at most, far below a heartbeat interval.
GATHER = 0.005  # seconds
_NOBLOCK = int(zmq.NOBLOCK)


class ServerTransport:
    """The ROUTER socket: receive (routing id, ZAP User-Id, payload), send without blocking."""

    def __init__(self, sock: TrioSocket) -> None:
        self.sock = sock
        self.dropped_sends = 0
        self.sent: Counter[str] = Counter()  # by kind, for the metrics
        self.throttle = Throttle()

    async def recv_batch(self) -> list[tuple[bytes, str, bytes]]:
        """Wait for one message, then take every message already queued (up to BATCH).

        The socket's own receives, frame by frame, while ZMQ_EVENTS shows one queued:
        pyzmq's recv_multipart and an `Again` at the end of every burst cost several
        times the receive itself (bench/README.md, "Control plane")."""
        await self.sock.wait_readable()
        return self.take_queued()

    def take_queued(self) -> list[tuple[bytes, str, bytes]]:
        """The messages already queued (up to BATCH), without waiting."""
        ts = self.sock
        raw = ts.sock
        batch: list[tuple[bytes, str, bytes]] = []
        while len(batch) < BATCH:
            try:
                head = raw.recv(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            if not head.more:  # a ROUTER always puts the routing id first; never seen
                continue
            body = raw.recv(_NOBLOCK, copy=False)  # a message's frames arrive together
            if body.more:
                parts = 2
                while body.more:
                    body = raw.recv(_NOBLOCK, copy=False)
                    parts += 1
                self.throttle.log(log, logging.WARNING, "frames",
                                  "dropped a message of %d frames (expected 2)", parts)
            else:
                try:
                    uid = body.get("User-Id")
                except zmq.ZMQError:
                    uid = ""
                batch.append((head.bytes, str(uid or ""), body.bytes))
            if not ts.readable():
                break
        return batch

    def send_all(self, out: list[Outgoing]) -> None:
        sent = self.sent
        for routing_id, msg in out:
            sent[codec.kind_of(msg)] += 1
            if not self.sock.try_send_routed(routing_id, codec.encode(msg)):
                self.dropped_sends += 1
                log.debug("dropped a message to a peer that is gone or full")


class KeyWatcher:
    """Reloads the authorized folder when it changes (or on SIGHUP)."""

    def __init__(self, folder: Path, clock: Callable[[], float] = time.time) -> None:
        self.folder = folder
        self.clock = clock
        self.keys: dict[bytes, KeyInfo] = {}
        self._stamp: tuple[int, ...] = ()
        # Called after every reload that changed the keys (whoever asked for it: the tick,
        # a request, ZAP meeting a new key, SIGHUP).
        self.on_change: Callable[[], None] = lambda: None

    def _current_stamp(self) -> tuple[int, ...]:
        # The folder's own mtime moves when a key is added, revoked (moved out) or
        # replaced by rename, which is how `llmgw keys` writes. Stat'ing every key file
        # each second would cost real CPU at tens of thousands of nodes; an edit in
        # place is picked up by SIGHUP.
        try:
            st = os.stat(self.folder)
        except OSError as exc:
            log.error("cannot read %s: %s", self.folder, exc)
            return self._stamp
        # Timestamps are as coarse as the kernel's tick: two changes within one tick leave
        # the same mtime. So a folder changed within the last two seconds is read again
        # until its mtime is older than that.
        if self.clock() - st.st_mtime_ns / 1e9 < 2.0:
            return ()
        return (st.st_mtime_ns, st.st_nlink, st.st_size)

    def reload_if_changed(self, force: bool = False) -> bool:
        stamp = self._current_stamp()
        if stamp and stamp == self._stamp and not force:
            return False
        self._stamp = stamp
        keys = load_authorized(str(self.folder))
        if keys == self.keys and not force:
            return False
        self.keys = keys
        self.on_change()
        return True

    def lookup(self, public_key: bytes) -> KeyInfo | None:
        """For ZAP: a key not known yet may have been issued a moment ago."""
        info = self.keys.get(public_key)
        if info is None and self.reload_if_changed():
            info = self.keys.get(public_key)
        return info

    def by_key(self) -> dict[str, KeyInfo]:
        return {user_id(k): k for k in self.keys.values()}


def answer_ops(cp: ControlPlane, cluster: Cluster) -> None:
    """What ctl and the routers may ask, answered from the cluster's state: ctl's ops
    (ops.py), API keys and limits (tenants/apikeys.py), `ctl gpu clear` (gpu_clear.py)."""
    cp.ops.update(Ops(cluster).ops())
    cp.ops.update(cluster.apikeys.ops())
    cp.ops.update(GpuClear(cluster).ops())


async def serve_server(
    config: ServerConfig,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    store: StateStore | None = None,
    not_leader: Callable[[], str] | None = None,
) -> None:
    """Run the control plane until cancelled. `task_status.started` gets the bound address.
    `store`: one already open (ha.py's, fenced by its lease), which the caller closes.
    `not_leader`: this is a leader's term (ha.py); when it ends, the requests it had taken
    and not answered are answered NotLeader naming the address this returns then."""
    keys_dir = Path(config.keys_dir)
    pair = load_pair(str(keys_dir / "server.key_secret"))
    watcher = KeyWatcher(keys_dir / "authorized")
    watcher.reload_if_changed(force=True)
    cp = ControlPlane(config=config, authorized=watcher.by_key())
    cp.clock_offset = time.time() - trio.current_time()

    def clock() -> float:
        return trio.current_time() + cp.clock_offset

    owned = store is None
    if store is None:
        store = await trio.to_thread.run_sync(open_store, config)
    metrics = ServerMetrics()
    orchestrator = Orchestrator(cp, metrics.timed(store), config, clock())
    answer_ops(cp, orchestrator)
    metrics.watch(orchestrator)

    ctx = zmq.Context()
    transport: ServerTransport | None = None
    try:
        async with trio.open_nursery() as nursery:
            # The ZAP handler must answer before the ROUTER binds: without one, libzmq
            # lets every CURVE client in.
            await nursery.start(functools.partial(serve_zap, on_denied=metrics.zap_denied), ctx,
                                watcher.lookup)
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_size)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.setsockopt(zmq.RCVHWM, 100_000)
            # Keepalive finds a vanished agent's connection: the agents' own silence is
            # the node's story (suspect, lost); this only gives back the connection's memory.
            curve_server(sock, pair)
            try:
                sock.bind(config.bind)
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                raise ListenError(f"cannot bind {config.bind}: {exc}") from None
            bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            transport = t = ServerTransport(TrioSocket(sock))
            metrics.sent, metrics.send_dropped = (lambda: t.sent), (lambda: t.dropped_sends)
            await nursery.start(orchestrator.serve, t.send_all, clock)
            nursery.start_soon(orchestrator.autoscale_loop, clock)
            watcher.on_change = functools.partial(_apply_keys, cp, watcher, t.send_all)
            nursery.start_soon(_sighup, watcher)
            if config.metrics_bind:
                await nursery.start(serve_server_http, config, orchestrator, metrics, clock)
            log.info("server listening on %s (CURVE, %d keys authorized)", bound, len(watcher.keys))
            task_status.started(bound)

            def refresh_keys() -> None:
                watcher.reload_if_changed()

            await run_plane(cp, t, on_tick=refresh_keys, on_rare_request=refresh_keys,
                            not_leader=not_leader)
    finally:
        # Only once every task that might send has finished.
        if transport is not None:
            # A term's last NotLeader answers get a moment to leave (ctx.term waits).
            transport.sock.close(linger=200 if not_leader is not None else 0)
        ctx.term()
        if owned:
            store.close()


class Transport(Protocol):
    async def recv_batch(self) -> list[tuple[bytes, str, bytes]]: ...
    def send_all(self, out: list[Outgoing]) -> None: ...


async def run_plane(
    cp: ControlPlane,
    transport: Transport,
    *,
    on_tick: Callable[[], None] | None = None,
    on_rare_request: Callable[[], None] | None = None,
    tick_interval: float = TICK_INTERVAL,
    gather: float = GATHER,
    not_leader: Callable[[], str] | None = None,
) -> None:
    """Receive and answer until cancelled, and apply silence every `tick_interval`.

    Whatever one message's handling raises is caught here, logged (bounded) and counted
    in `cp.failed`: that message is dropped, the peer's session and every other peer go
    on. `on_rare_request` runs before each message from an admin or router key (rare:
    ctl, and each router once a second), so that a key revoked a moment ago is refused
    on its next request, not at the next tick. `not_leader` (a leader's term): once
    cancelled, every request taken and not answered yet, and every one still queued, is
    answered NotLeader(not_leader()) at once, not left to the client's timeout (failover
    past a frozen leader).
    """
    pending: set[tuple[bytes, str]] = set()  # deferred requests not answered yet

    async def farewell() -> None:
        assert not_leader is not None
        try:
            await trio.sleep_forever()
        finally:
            # Runs as soon as the plane is cancelled, while a deferred request may still
            # be waiting for its thread (a database that does not answer).
            leader = not_leader()
            out: list[Outgoing] = [(rid, NotLeader(leader, request_id)) for rid, request_id in pending]
            pending.clear()
            if isinstance(transport, ServerTransport):
                for rid, _uid, payload in transport.take_queued():
                    try:
                        msg = codec.decode(payload)
                    except LlmgwError:
                        continue
                    if isinstance(msg, Request):
                        out.append((rid, NotLeader(leader, msg.request_id)))
            try:
                transport.send_all(out)
            except Exception:
                log.exception("cannot answer %d pending request(s) NotLeader", len(out))
            if out:
                log.info("answered %d pending request(s): not the leader any more (%s)", len(out),
                         leader or "the leader is not known yet")

    async def ticker() -> None:
        while True:
            await trio.sleep(tick_interval)
            try:
                if on_tick is not None:
                    on_tick()
                transport.send_all(cp.tick(trio.current_time() + cp.clock_offset))
            except Exception:
                cp.failed += 1
                log.exception("a tick of the control plane failed")

    async def finish(rid: bytes, request_id: str, work: Awaitable[Any]) -> None:
        pending.add((rid, request_id))
        reply: Reply | NotLeader
        try:
            reply = Reply(request_id, True, result=await work)
        except FencedError:
            # Another server leads now: the client should ask it, not give up.
            reply = NotLeader(not_leader() if not_leader is not None else "", request_id)
        except InternalError:  # a bug of ours (a lifecycle table's): a traceback, not the reason
            cp.bug(str(rid), "request %s failed", request_id)
            reply = Reply(request_id, False, error="internal error; see the server's log")
        except LlmgwError as exc:
            reply = Reply(request_id, False, error=str(exc))
        except Exception:
            cp.bug(str(rid), "request %s failed", request_id)
            reply = Reply(request_id, False, error="internal error; see the server's log")
        if (rid, request_id) not in pending:
            return  # answered NotLeader already: the term ended while this was under way
        pending.discard((rid, request_id))
        try:
            transport.send_all([(rid, reply)])
        except Exception:
            cp.failed += 1
            log.exception("cannot send the reply to request %s", clip(request_id, 100))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        if not_leader is not None:
            nursery.start_soon(farewell)
        while True:
            batch = await transport.recv_batch()
            now = trio.current_time() + cp.clock_offset
            for rid, uid, payload in batch:
                try:
                    if on_rare_request is not None and cp.role_of(uid) != "node":
                        on_rare_request()
                    transport.send_all(cp.handle(rid, uid, payload, now))
                except Exception:
                    cp.bug(uid, "handling a message from %s failed (message dropped)", uid)
            while cp.deferred:
                nursery.start_soon(finish, *cp.deferred.pop(0))
            # A flood must not starve the ticker or the deferred requests; a trickle
            # gathers for a moment first.
            if gather > 0 and len(batch) < BATCH:
                await trio.sleep(gather)
            else:
                await trio.lowlevel.checkpoint()


def _apply_keys(cp: ControlPlane, watcher: KeyWatcher, send_all: Callable[[list[Outgoing]], None]) -> None:
    send_all(cp.set_authorized(watcher.by_key()))
    log.info("authorized keys reloaded: %d", len(watcher.keys))


async def _sighup(watcher: KeyWatcher) -> None:
    if trio.lowlevel.current_root_task() is None:  # pragma: no cover
        return
    try:
        with trio.open_signal_receiver(signal.SIGHUP) as signals:
            async for _ in signals:
                watcher.reload_if_changed(force=True)
    except RuntimeError:
        # Signals can only be caught on the main thread; tests may run us elsewhere.
        log.debug("SIGHUP reload unavailable off the main thread")

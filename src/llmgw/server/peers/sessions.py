"""The server's sessions with its peers, without I/O (h11-style: bytes and time in,
messages out).

Every message arrives with the User-Id that ZAP bound to the connection: the public key
that authenticated it. Each message is checked against the authorized set as it is now,
by that key, so a revoked key stays out even when its name is issued again with a new
key. A node's Hello must name the node its key was issued for.

Nothing a peer sends is stored without a bound: engine reports only for replicas the
node was asked to run or reported at Hello, log tails cut to TAIL_BYTES; and every log
line that carries peer text is clipped and rate-limited per peer (llmgw.logbound).

Requests from ctl and routers are dispatched through `ops`, a table of op class ->
(roles allowed, handler), which later parts of the server extend; handlers get the op
already validated by the codec.
"""

from __future__ import annotations

import inspect
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping
from types import MappingProxyType
from typing import Any

from attrs import define, evolve, field

from llmgw import PROTOCOL_VERSION
from llmgw.config.addresses import AddressError, parse_tcp
from llmgw.config.server import ServerConfig
from llmgw.errors import InternalError, LlmgwError, ProtocolError
from llmgw.logbound import Throttle, clip
from llmgw.model.engine import EngineReport
from llmgw.model.inventory import Inventory, NodeInfo
from llmgw.model.node import NodeState
from llmgw.server.peers import node_states
from llmgw.server.peers.intern import Interner
from llmgw.server.peers.node_states import NodeBirth, NodeEvent, born, next_state, silence_event
from llmgw.server.store.sql import StoredNode
from llmgw.transport import codec
from llmgw.transport.keys import KeyInfo
from llmgw.transport.messages import (
    EngineChanged,
    Heartbeat,
    HeartbeatAck,
    Hello,
    HelloFirst,
    InventoryChanged,
    LogsReply,
    Message,
    Refused,
    Reply,
    Request,
    RouterKeys,
    Welcome,
)
from llmgw.transport.requests import op_name

log = logging.getLogger(__name__)

Outgoing = tuple[bytes, Message]  # (routing id, message)
# A handler returns its result, or an awaitable of it (ops that write the store).
OpHandler = Callable[["Peer", Any, float], Any]
Deferred = tuple[bytes, str, Awaitable[Any]]  # routing id, request id, the work

# The most of one engine's log tail kept from a report (the newest lines), and of one line.
TAIL_BYTES = 32 * 1024
TAIL_LINE = 1024
# The most engines one Hello may report (a node runs a few per GPU at most).
MAX_HELLO_ENGINES = 1024
# Ports a node reported in conflict (another process holds them) are kept this many per
# node, for this long (seconds), or until its next Hello; placement never assigns them.
MAX_CONFLICT_PORTS = 256
CONFLICT_PORT_TTL = 600.0


class RequestError(LlmgwError):
    """Raised by an op handler: becomes Reply(ok=False, error=message)."""


@define(frozen=True)
class Peer:
    routing_id: bytes
    role: str
    identity: str
    key: str = ""  # the z85 public key that authenticated this connection


@define
class Node:
    node_id: str
    info: NodeInfo
    inventory: Inventory
    state: NodeState
    last_seen: float
    routing_id: bytes
    engines: dict[str, EngineReport] = field(factory=dict)
    connected: bool = True  # has a live session (cut on revocation)
    # The public key of the live session; its messages alone are the node's. A node
    # remembered after a restart: the node key authorized under its name (its KV relay's key
    # in the endpoint table), which no message is taken from before its Hello.
    key: str = ""
    cordoned: bool = False  # placement puts nothing new here (ctl cordon, drain)
    draining: bool = False  # its replicas move away, new ones ready first (ctl drain)
    # When it went silent (suspect, lost); None: ready. Kept by ControlPlane, the node
    # table's owner, beside `state` (node_states.silent_since).
    silent_since: float | None = None
    # Ports the node reported in conflict -> when (server clock). Bounded: the oldest go
    # first past MAX_CONFLICT_PORTS; expired after CONFLICT_PORT_TTL; cleared on Hello.
    conflict_ports: dict[int, float] = field(factory=dict)
    # `inventory` came through the control plane's Interner (not straight from the store).
    shared: bool = False

    def note_conflict(self, port: int, now: float) -> None:
        """Remember that `port` is held by a process that is not an engine of ours."""
        if not 0 < port < 65536:
            return
        self.conflict_ports.pop(port, None)
        self.conflict_ports[port] = now
        while len(self.conflict_ports) > MAX_CONFLICT_PORTS:
            del self.conflict_ports[next(iter(self.conflict_ports))]

    def expire_conflicts(self, now: float) -> None:
        if self.conflict_ports:
            self.conflict_ports = {p: t for p, t in self.conflict_ports.items()
                                   if now - t < CONFLICT_PORT_TTL}


@define
class ControlPlane:
    config: ServerConfig
    # The node table, node id -> Node: this object alone adds to it (Hello, seed) and
    # changes what it says of a node's cordon; others read it through `nodes`.
    _nodes: dict[str, Node] = field(factory=dict, init=False)
    _nodes_view: Mapping[str, Node] = field(init=False, repr=False, eq=False)
    # Public keys (z85) currently authorized, with their role and name; messages that
    # arrive over a connection authenticated by any other key are refused.
    authorized: dict[str, KeyInfo] = field(factory=dict)
    ops: dict[type, tuple[frozenset[str], OpHandler]] = field(factory=dict)
    # Called after a node's Hello ("hello"), inventory ("inventory") or engine report
    # ("engine") changes what the rest of the server knows.
    on_node_change: Callable[[Node, float, str], list[Outgoing]] | None = None
    # Requests whose answer needs I/O: the shell awaits them and sends the Reply.
    deferred: list[Deferred] = field(factory=list)
    # After a server restart, no node is declared lost before this time (`remember`).
    lost_not_before: float = 0.0
    # Added to trio's clock to make wall-clock time (what the store keeps).
    clock_offset: float = 0.0
    # Called every tick with the nodes whose state changed (and their previous state).
    on_tick: Callable[[list[tuple[Node, NodeState]], float], list[Outgoing]] | None = None
    # Called when a message from a suspect or lost node makes it ready again (no tick
    # says so): the orchestrator's passes look only at nodes they are told changed.
    on_back: Callable[[Node, float], None] | None = None
    pending_logs: dict[str, Callable[[LogsReply], None]] = field(factory=dict)
    # The replica ids a node is asked to run now (the orchestrator's desired sets).
    desired_ids: Callable[[str], Collection[str]] = lambda node_id: ()
    dropped: int = 0  # messages dropped as malformed, unauthorized or unexpected
    failed: int = 0  # messages (or ticks, or requests) whose handling raised: a bug of ours
    # Warnings a peer can cause, per (peer, what): a few, then one a minute with a count.
    throttle: Throttle = field(factory=Throttle)
    # For the metrics: messages decoded, by kind; messages refused or dropped, by reason
    # (a fixed vocabulary: never peer text).
    received: Counter[str] = field(factory=Counter)
    refusals: Counter[str] = field(factory=Counter)
    # Inventories' equal parts, kept once for all nodes (intern.py).
    interner: Interner = field(factory=Interner)
    # The router keys of `authorized`, and the dict they were read from: agents with a
    # KV relay get them at each Hello, which must not walk 50,000 node keys each time.
    _router_keys: tuple[str, ...] = field(default=(), init=False, repr=False, eq=False)
    _router_keys_of: object = field(default=None, init=False, repr=False, eq=False)

    @_nodes_view.default
    def _view_of_nodes(self) -> Mapping[str, Node]:
        return MappingProxyType(self._nodes)

    # ---- the node table ----

    @property
    def nodes(self) -> Mapping[str, Node]:
        """The node table, node id -> Node, read-only (a live view, not a copy)."""
        return self._nodes_view

    def seed(self, node: Node) -> None:
        """Put `node` in the table before its agent is heard (a node the store knows of,
        after a restart); it replaces any node of its id."""
        self._nodes[node.node_id] = node

    def remember(self, stored: Mapping[str, StoredNode], now: float) -> None:
        """After a restart: the nodes the store knows of, born suspect (silent since `now`)
        until their agents say Hello again, and the restart grace before any is lost."""
        state = born(NodeBirth.REMEMBERED)
        node_keys = {info.name: k for k, info in self.authorized.items() if info.role == "node"}
        for node_id, n in stored.items():
            self._nodes[node_id] = Node(node_id, n.info, n.inventory, state, now, b"", connected=False,
                                        key=node_keys.get(node_id, ""),
                                        cordoned=n.cordoned, draining=n.draining,
                                        silent_since=node_states.silent_since(state, None, now))
        self.lost_not_before = now + self.config.restart_grace

    def _move(self, node: Node, event: NodeEvent) -> NodeState:
        """The node's state after `event`, with when it went silent kept beside it; the
        state it had before is returned."""
        before = node.state
        node.state = next_state(before, event)
        node.silent_since = node_states.silent_since(node.state, node.silent_since, node.last_seen)
        return before

    def set_cordoned(self, node_id: str, cordoned: bool, draining: bool) -> None:
        """ctl cordon, uncordon, drain: what placement may put on the node, and whether its
        replicas move away. KeyError when no node has that id."""
        node = self._nodes[node_id]
        node.cordoned, node.draining = cordoned, draining

    def warn(self, peer: str, what: str, fmt: str, *args: object) -> None:
        self.throttle.log(log, logging.WARNING, (peer, what), fmt, *args)

    def bug(self, key: str, fmt: str, *args: object) -> None:
        """Inside an `except`: a failure of ours, counted (`failed`, a metric) and logged with
        its traceback, at most a few lines per key a minute."""
        self.failed += 1
        self.throttle.bug(log, (key, "failed"), fmt, *args)

    # ---- inbound ----

    def role_of(self, uid: str) -> str:
        info = self.authorized.get(uid)
        return info.role if info is not None else ""

    def handle(self, routing_id: bytes, uid: str, payload: bytes, now: float) -> list[Outgoing]:
        if not uid:
            self.dropped += 1
            self.refusals["no_user_id"] += 1
            self.warn("", "no-uid", "dropped a message without a ZAP User-Id")
            return []
        info = self.authorized.get(uid)
        if info is None:
            self.dropped += 1
            self.refusals["unauthorized_key"] += 1
            self.warn(uid, "revoked", "refused a message from key %s: not authorized (revoked?)", uid)
            return [(routing_id, Refused(reason="this key is not authorized (revoked?)"))]
        role, identity = info.role, info.name
        peer = Peer(routing_id, role, identity, uid)
        try:
            msg = codec.decode(payload)
        except ProtocolError as exc:
            self.dropped += 1
            self.refusals["bad_message"] += 1
            self.warn(uid, "bad", "dropped a bad message from %s %s: %s", role, identity, exc)
            if exc.request_id and role != "node":
                return [(routing_id, Reply(exc.request_id, False, error=str(exc)))]
            return []
        self.received[codec.kind_of(msg)] += 1
        if isinstance(msg, Request):
            reply = self._request(peer, msg, now)
            return [(routing_id, reply)] if reply is not None else []
        if role != "node":
            self.dropped += 1
            self.refusals["wrong_role"] += 1
            self.warn(uid, "kind", "dropped %s from %s %s: only nodes send it", codec.kind_of(msg), role,
                      identity)
            return []
        if isinstance(msg, Hello):
            return self._hello(peer, msg, now)
        node = self._nodes.get(identity)
        if node is None or not node.connected or node.key != uid:
            self.refusals["no_session"] += 1
            return [(routing_id, HelloFirst(reason="no session; send Hello"))]
        self._heard(node, routing_id, now)
        if isinstance(msg, Heartbeat):
            return [(routing_id, HeartbeatAck(seq=msg.seq))]
        if isinstance(msg, InventoryChanged):
            self._set_inventory(node, msg.inventory)
            return self._changed(node, now, "inventory")
        if isinstance(msg, EngineChanged):
            rid = msg.report.replica_id
            if rid not in node.engines and rid not in self.desired_ids(identity):
                self.dropped += 1
                self.refusals["unexpected_report"] += 1
                self.warn(uid, "report", "dropped a report from node %s for replica %s: not asked to run "
                          "it, nor reported at Hello", identity, rid)
                return []
            node.engines[rid] = bounded_report(msg.report)
            if msg.report.conflict_port:
                node.note_conflict(msg.report.conflict_port, now)
            return self._changed(node, now, "engine")
        if isinstance(msg, LogsReply):
            waiter = self.pending_logs.pop(msg.request_id, None)
            if waiter is not None:
                waiter(msg)
            return []
        self.dropped += 1
        self.refusals["wrong_kind"] += 1
        self.warn(uid, "kind", "dropped %s from node %s: not a message a node sends", codec.kind_of(msg),
                  identity)
        return []

    def _hello(self, peer: Peer, msg: Hello, now: float) -> list[Outgoing]:
        claimed = msg.node.node_id
        if msg.protocol != PROTOCOL_VERSION:
            reason = f"protocol {msg.protocol} not supported; this server speaks {PROTOCOL_VERSION}"
            self.refusals["protocol"] += 1
            return [(peer.routing_id, Refused(reason=reason))]
        if claimed != peer.identity:
            self.refusals["identity_mismatch"] += 1
            self.warn(peer.key, "claim", "refused Hello: key bound to %r claims node %r", peer.identity,
                      claimed)
            reason = f"this key is bound to node {peer.identity!r}, but Hello claims {clip(claimed, 200)!r}"
            return [(peer.routing_id, Refused(reason=reason))]
        if len(msg.engines) > MAX_HELLO_ENGINES:
            self.refusals["too_many_engines"] += 1
            self.warn(peer.key, "claim", "refused Hello from node %s: %d engines (at most %d)", claimed,
                      len(msg.engines), MAX_HELLO_ENGINES)
            reason = f"Hello reports {len(msg.engines)} engines; at most {MAX_HELLO_ENGINES}"
            return [(peer.routing_id, Refused(reason=reason))]
        msg = self._checked_relay(peer, msg)
        node = self._nodes.get(claimed)
        engines = {r.replica_id: bounded_report(r) for r in msg.engines}
        if node is None:
            node = Node(claimed, msg.node, self.interner.inventory(msg.inventory), born(NodeBirth.JOINED),
                        now, peer.routing_id, shared=True)
            self._nodes[claimed] = node
            log.info("node %s joined from %s", claimed, msg.node.mgmt_addr)
        else:
            node.info = msg.node
            self._set_inventory(node, msg.inventory)
            node.connected = True
            self._heard(node, peer.routing_id, now)
        node.key = peer.key
        node.engines = engines
        # A Hello starts the node's story again: only what it reports now is in conflict.
        node.conflict_ports.clear()
        for r in engines.values():
            if r.conflict_port:
                node.note_conflict(r.conflict_port, now)
        welcome = Welcome(PROTOCOL_VERSION, claimed, self.config.heartbeat_interval)
        out: list[Outgoing] = [(peer.routing_id, welcome)]
        if node.info.kv_relay:
            # Before the desired set: the relay may let routers in as soon as it listens.
            out.append((peer.routing_id, RouterKeys(self.router_keys())))
        return [*out, *self._changed(node, now, "hello")]

    def _checked_relay(self, peer: Peer, msg: Hello) -> Hello:
        """The Hello with its KV relay address kept only where it is one a router can dial
        (the endpoint table hands it on): a bad one costs the relay, never the node."""
        relay = msg.node.kv_relay
        if not relay:
            return msg
        try:
            parse_tcp(relay)
        except AddressError as exc:
            self.refusals["bad_kv_relay"] += 1
            self.warn(peer.key, "kv_relay", "node %s: ignored its KV relay address %r: %s", peer.identity,
                      clip(relay, 100), exc)
            return evolve(msg, node=evolve(msg.node, kv_relay=""))
        return msg

    def _set_inventory(self, node: Node, inventory: Inventory) -> None:
        # An agent that says Hello again mostly reports what it did: keep the shared copy.
        if not (node.shared and node.inventory == inventory):
            node.inventory = self.interner.inventory(inventory)
            node.shared = True

    def _heard(self, node: Node, routing_id: bytes, now: float) -> None:
        node.last_seen = now
        before = self._move(node, NodeEvent.HEARD)
        # Server-initiated messages go only to the routing id last seen authenticated.
        node.routing_id = routing_id
        if before != node.state:
            log.info("node %s: %s -> %s", node.node_id, before, node.state)
            if self.on_back is not None:
                self.on_back(node, now)

    def _changed(self, node: Node, now: float, what: str) -> list[Outgoing]:
        return self.on_node_change(node, now, what) if self.on_node_change else []

    def _request(self, peer: Peer, req: Request, now: float) -> Reply | None:
        if req.protocol != PROTOCOL_VERSION:
            self.refusals["protocol"] += 1
            return Reply(req.request_id, False, error=f"protocol {req.protocol} not supported")
        name = op_name(type(req.op))
        entry = self.ops.get(type(req.op))
        if entry is None:
            self.refusals["unknown_op"] += 1
            return Reply(req.request_id, False, error=f"this server does not answer {name!r} requests")
        roles, handler = entry
        if peer.role not in roles:
            self.refusals["role"] += 1
            self.warn(peer.key, "role", "refused %s request from %s %s", name, peer.role, peer.identity)
            return Reply(req.request_id, False, error=f"a {peer.role} key may not ask for {name!r}")
        try:
            result = handler(peer, req.op, now)
        except InternalError:  # a bug of ours (a lifecycle table's): a traceback, not the reason
            self.bug(peer.key, "request %s from %s %s failed", name, peer.role, peer.identity)
            return Reply(req.request_id, False, error="internal error; see the server's log")
        except LlmgwError as exc:
            return Reply(req.request_id, False, error=str(exc))
        except Exception:
            self.bug(peer.key, "request %s from %s %s failed", name, peer.role, peer.identity)
            return Reply(req.request_id, False, error="internal error; see the server's log")
        if inspect.isawaitable(result):
            self.deferred.append((peer.routing_id, req.request_id, result))
            return None
        return Reply(req.request_id, True, result=result)

    # ---- timers and keys ----

    def tick(self, now: float) -> list[Outgoing]:
        """Apply silence to every node; tell `on_tick` which nodes changed state."""
        suspect_after = self.config.heartbeat_interval * self.config.suspect_after_missed
        changed = []
        for node in self._nodes.values():
            node.expire_conflicts(now)
            event = silence_event(now - node.last_seen, suspect_after, self.config.lost_after,
                                  in_restart_grace=now < self.lost_not_before)
            if event is None:
                continue
            before = self._move(node, event)
            if node.state != before:
                log.warning("node %s: %s -> %s (silent %.0fs)", node.node_id, before,
                            node.state, now - node.last_seen)
                changed.append((node, before))
        return self.on_tick(changed, now) if self.on_tick else []

    def set_authorized(self, keys: dict[str, KeyInfo]) -> list[Outgoing]:
        """New set of authorized keys; live sessions of every other key are cut."""
        before = self.router_keys()
        self.authorized = keys
        routers = self.router_keys()
        out: list[Outgoing] = []
        for node in self._nodes.values():
            if node.connected and node.key not in keys:
                node.connected = False
                self.refusals["revoked"] += 1
                log.warning("node %s: key revoked, session cut", node.node_id)
                out.append((node.routing_id, Refused(reason="this node's key was revoked")))
            elif routers != before and node.connected and node.info.kv_relay:
                out.append((node.routing_id, RouterKeys(routers)))
        return out

    def router_keys(self) -> tuple[str, ...]:
        """The public keys (z85) of the router keys authorized now, sorted: what the agents'
        KV relays may let in (RouterKeys)."""
        if self._router_keys_of is not self.authorized:
            self._router_keys = tuple(sorted(k for k, info in self.authorized.items()
                                             if info.role == "router"))
            self._router_keys_of = self.authorized
        return self._router_keys



def bounded_report(report: EngineReport) -> EngineReport:
    """The report with its log tail cut to its newest TAIL_BYTES, each line to TAIL_LINE."""
    tail = report.log_tail
    if not tail:
        return report
    kept: list[str] = []
    size = 0
    for line in reversed(tail):
        line = clip(line, TAIL_LINE)
        size += len(line) + 1
        if size > TAIL_BYTES:
            break
        kept.append(line)
    if len(kept) == len(tail) and all(a is b for a, b in zip(reversed(kept), tail, strict=True)):
        return report
    return evolve(report, log_tail=tuple(reversed(kept)))

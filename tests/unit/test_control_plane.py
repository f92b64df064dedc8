"""The server's sessions without I/O: identity by key, bounded state, bounded logs, and a
handler that raises costing one message."""

from __future__ import annotations

import logging
import math
from typing import Any

import msgpack
import pytest
import trio

from llmgw import PROTOCOL_VERSION
from llmgw.config.server import ServerConfig
from llmgw.logbound import Throttle, clip
from llmgw.model.deployment import ReplicaState
from llmgw.model.engine import EngineReport, EngineState
from llmgw.model.inventory import Gpu, Inventory, NodeInfo
from llmgw.model.node import NodeState
from llmgw.server.peers.node_states import InvalidNodeTransition, NodeEvent
from llmgw.server.peers.service import run_plane
from llmgw.server.peers.sessions import TAIL_BYTES, ControlPlane, Outgoing
from llmgw.server.reconcile.replica_states import InvalidReplicaTransition, ReplicaEvent
from llmgw.transport import codec
from llmgw.transport.keys import KeyInfo
from llmgw.transport.messages import (
    EngineChanged,
    Heartbeat,
    HeartbeatAck,
    Hello,
    HelloFirst,
    Refused,
    Reply,
    Request,
    Welcome,
)
from llmgw.transport.requests import DeleteOp, DescribeOp, StatusOp

CONFIG = ServerConfig(heartbeat_interval=5.0)
OLD = "K" * 40  # z85 public keys, as ZAP hands them over
NEW = "N" * 40
ADMIN = "A" * 40


def keyset(**keys: tuple[str, str]) -> dict[str, KeyInfo]:
    return {k: KeyInfo(name, role, k.encode()) for k, (role, name) in keys.items()}


def hello(node_id: str = "n1", engines: tuple[EngineReport, ...] = ()) -> bytes:
    return codec.encode(Hello(PROTOCOL_VERSION, NodeInfo(node_id, "10.0.0.1"), Inventory(), engines))


def kinds(out: list[Outgoing]) -> list[type]:
    return [type(m) for _, m in out]


def test_reissued_name_never_readmits_the_old_key() -> None:
    cp = ControlPlane(config=CONFIG, authorized=keyset(**{OLD: ("node", "n1")}))
    assert Welcome in kinds(cp.handle(b"old", OLD, hello(), 0.0))
    # Revoked: the live session is cut.
    assert kinds(cp.set_authorized({})) == [Refused]
    # The name issued again, with a new key.
    cp.set_authorized(keyset(**{NEW: ("node", "n1")}))
    for payload in (hello(), codec.encode(Heartbeat(1))):
        assert kinds(cp.handle(b"old", OLD, payload, 1.0)) == [Refused]
    assert not cp.nodes["n1"].connected
    # The new key is welcome, and its session is the node's.
    assert Welcome in kinds(cp.handle(b"new", NEW, hello(), 2.0))
    assert cp.nodes["n1"].key == NEW
    assert kinds(cp.handle(b"new", NEW, codec.encode(Heartbeat(2)), 3.0)) == [HeartbeatAck]


def admin_plane(keys: dict[str, KeyInfo]) -> ControlPlane:
    cp = ControlPlane(config=CONFIG, authorized=keys)
    cp.ops[StatusOp] = (frozenset({"admin"}), lambda peer, op, now: {"nodes": []})
    return cp


def test_revoked_admin_key_refused_on_its_next_request() -> None:
    cp = admin_plane(keyset(**{ADMIN: ("admin", "ops")}))
    req = codec.encode(Request(PROTOCOL_VERSION, "q1", StatusOp()))
    reply = cp.handle(b"a", ADMIN, req, 0.0)
    assert isinstance(reply[0][1], Reply) and reply[0][1].ok
    cp.set_authorized(keyset(**{NEW: ("admin", "ops")}))  # revoked, the name re-issued
    assert kinds(cp.handle(b"a", ADMIN, req, 1.0)) == [Refused]


def test_messages_of_another_key_for_the_same_node_need_a_hello() -> None:
    keys = keyset(**{OLD: ("node", "n1")})
    cp = ControlPlane(config=CONFIG, authorized=keys)
    cp.handle(b"old", OLD, hello(), 0.0)
    cp.set_authorized(keyset(**{NEW: ("node", "n1")}))
    assert kinds(cp.handle(b"new", NEW, codec.encode(Heartbeat(1)), 1.0)) == [HelloFirst]


def report(rid: str, tail: tuple[str, ...] = ()) -> bytes:
    return codec.encode(EngineChanged(EngineReport(rid, 1, EngineState.EXITED, log_tail=tail)))


def test_reports_for_made_up_replicas_are_not_stored() -> None:
    cp = ControlPlane(config=CONFIG, authorized=keyset(**{OLD: ("node", "n1")}))
    cp.desired_ids = lambda node_id: {"d-0"} if node_id == "n1" else set()
    at_hello = (EngineReport("adopted-0", 4, EngineState.READY),)
    cp.handle(b"r", OLD, hello(engines=at_hello), 0.0)
    for i in range(1000):
        assert cp.handle(b"r", OLD, report(f"made-up-{i}", ("x" * 1000,)), 1.0) == []
    cp.handle(b"r", OLD, report("d-0"), 1.0)
    cp.handle(b"r", OLD, report("adopted-0"), 1.0)
    assert set(cp.nodes["n1"].engines) == {"d-0", "adopted-0"}
    assert cp.dropped == 1000


def test_log_tails_are_cut_to_their_newest_bytes() -> None:
    cp = ControlPlane(config=CONFIG, authorized=keyset(**{OLD: ("node", "n1")}))
    cp.desired_ids = lambda node_id: {"d-0"}
    cp.handle(b"r", OLD, hello(), 0.0)
    tail = tuple(f"{i:06d}" + "y" * 5000 for i in range(200))
    cp.handle(b"r", OLD, report("d-0", tail), 1.0)
    kept = cp.nodes["n1"].engines["d-0"].log_tail
    assert sum(len(line) + 1 for line in kept) <= TAIL_BYTES
    assert kept[-1].startswith("000199") and "more bytes" in kept[-1]
    short = ("a", "b")
    cp.handle(b"r", OLD, report("d-0", short), 2.0)
    assert cp.nodes["n1"].engines["d-0"].log_tail == short


def test_hello_with_too_many_engines_is_refused() -> None:
    cp = ControlPlane(config=CONFIG, authorized=keyset(**{OLD: ("node", "n1")}))
    many = tuple(EngineReport(f"r-{i}", 1, EngineState.READY) for i in range(2000))
    assert kinds(cp.handle(b"r", OLD, hello(engines=many), 0.0)) == [Refused]
    assert "n1" not in cp.nodes


def test_log_lines_about_one_peer_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    cp = ControlPlane(config=CONFIG, authorized=keyset(**{OLD: ("node", "n1")}))
    big = msgpack.packb({"kind": "hello", "protocol": PROTOCOL_VERSION,
                         "node": {"node_id": "n1", "mgmt_addr": "x"},
                         "inventory": {"gpus": list(range(2000))}})
    with caplog.at_level(logging.WARNING, logger="llmgw.server.peers.sessions"):
        for _ in range(1000):
            cp.handle(b"r", OLD, big, 0.0)
            cp.handle(b"r", OLD, b"\xc1" * 5000, 0.0)
    assert caplog.records, "the first bad messages are logged"
    assert len(caplog.records) <= 2 * cp.throttle.burst
    assert max(len(r.getMessage()) for r in caplog.records) < 4096


def test_throttle_lets_a_few_through_then_one_per_period_with_the_count() -> None:
    now = [0.0]
    t = Throttle(burst=3, period=60.0, clock=lambda: now[0])
    assert [t.allow("p") for _ in range(5)] == [(True, 0)] * 3 + [(False, 0)] * 2
    now[0] = 61.0
    assert t.allow("p") == (True, 2)
    assert t.allow("p") == (False, 0)
    assert t.allow("q") == (True, 0)  # another peer has its own budget


def test_a_bug_is_logged_with_its_traceback_and_throttled(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    t = Throttle(burst=2, period=60.0, clock=lambda: 0.0)
    logger = logging.getLogger("test.bug")
    with caplog.at_level(logging.ERROR, logger="test.bug"):
        for _ in range(4):
            try:
                raise ValueError("boom")
            except ValueError:
                t.bug(logger, "k", "handling %s failed", "x")
    assert [r.getMessage() for r in caplog.records] == ["handling x failed"] * 2
    assert all(r.levelno == logging.ERROR and r.exc_info and r.exc_info[0] is ValueError
               for r in caplog.records)


def test_throttle_keeps_a_bounded_number_of_keys() -> None:
    t = Throttle(max_keys=100)
    for i in range(10_000):
        t.allow(i)
    assert len(t._seen) <= 100


def test_clip() -> None:
    assert clip("abc") == "abc"
    cut = clip("x" * 5000, 2048)
    assert cut.startswith("x" * 2048) and cut.endswith("… 2952 more bytes")
    assert clip(b"\x00" * 10, 8).startswith("b'\\x00")


class MemTransport:
    def __init__(self) -> None:
        self.send_in, self.recv_in = trio.open_memory_channel[tuple[bytes, str, bytes]](math.inf)
        self.sent: list[Outgoing] = []

    async def recv_batch(self) -> list[tuple[bytes, str, bytes]]:
        return [await self.recv_in.receive()]

    def send_all(self, out: list[Outgoing]) -> None:
        self.sent.extend(out)


async def test_a_handler_that_raises_costs_one_message(autojump_clock: trio.testing.MockClock) -> None:
    cp = admin_plane(keyset(**{OLD: ("node", "n1"), ADMIN: ("admin", "ops")}))

    def broken(peer: Any, params: Any, now: float) -> Any:
        raise RuntimeError("a bug in one handler")

    async def broken_later(peer: Any, params: Any, now: float) -> Any:
        raise RuntimeError("a bug in one deferred handler")

    cp.ops[DescribeOp] = (frozenset({"admin"}), broken)
    cp.ops[DeleteOp] = (frozenset({"admin"}), broken_later)
    # A bug outside the op table too: the engine-change hook of the orchestrator.
    cp.desired_ids = lambda node_id: {"d-0"}

    def bad_hook(node: Any, now: float, what: str) -> list[Outgoing]:
        if what == "engine":
            raise KeyError("a bug in a hook")
        return []

    cp.on_node_change = bad_hook
    t = MemTransport()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_plane, cp, t)
        t.send_in.send_nowait((b"n", OLD, hello()))
        for rid, op in (("broken", DescribeOp("d")), ("broken_later", DeleteOp("d")), ("status", StatusOp())):
            t.send_in.send_nowait((b"a", ADMIN, codec.encode(Request(PROTOCOL_VERSION, rid, op))))
        t.send_in.send_nowait((b"n", OLD, report("d-0")))
        t.send_in.send_nowait((b"n", OLD, codec.encode(Heartbeat(9))))
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    replies = {m.request_id: m for _, m in t.sent if isinstance(m, Reply)}
    assert replies["status"].ok
    assert not replies["broken"].ok and "internal error" in replies["broken"].error
    assert not replies["broken_later"].ok and "internal error" in replies["broken_later"].error
    assert any(isinstance(m, HeartbeatAck) and m.seq == 9 for _, m in t.sent)
    assert cp.failed == 3  # the synchronous handler, the deferred one and the hook
    assert cp.nodes["n1"].connected


async def test_a_lifecycle_tables_error_is_internal_not_the_operators(
        autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    """An invalid transition is a bug of ours: the operator reads "internal error", the log
    has the traceback; the table's own message is not handed out as a refusal's reason."""
    cp = admin_plane(keyset(**{ADMIN: ("admin", "ops")}))

    def broken(peer: Any, params: Any, now: float) -> Any:
        raise InvalidReplicaTransition(ReplicaState.READY, ReplicaEvent.ADOPTED)

    async def broken_later(peer: Any, params: Any, now: float) -> Any:
        raise InvalidNodeTransition(NodeState.READY, NodeEvent.HEARD)

    cp.ops[DescribeOp] = (frozenset({"admin"}), broken)
    cp.ops[DeleteOp] = (frozenset({"admin"}), broken_later)
    t = MemTransport()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_plane, cp, t)
        for rid, op in (("broken", DescribeOp("d")), ("broken_later", DeleteOp("d"))):
            t.send_in.send_nowait((b"a", ADMIN, codec.encode(Request(PROTOCOL_VERSION, rid, op))))
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    replies = {m.request_id: m for _, m in t.sent if isinstance(m, Reply)}
    for rid in ("broken", "broken_later"):
        assert not replies[rid].ok and replies[rid].error == "internal error; see the server's log"
    assert cp.failed == 2
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert {type(r.exc_info[1]) for r in tracebacks if r.exc_info} == {
        InvalidReplicaTransition, InvalidNodeTransition}


def test_gpu_list_in_hello_is_still_structured() -> None:
    # A sanity check that the strictness above does not refuse a real inventory.
    cp = ControlPlane(config=CONFIG, authorized=keyset(**{OLD: ("node", "n1")}))
    inv = Inventory(gpus=(Gpu(0, "GPU-a", "H100", 81559, 80000, "00000000:18:00.0", 0),))
    out = cp.handle(b"r", OLD, codec.encode(Hello(PROTOCOL_VERSION, NodeInfo("n1", "x"), inv)), 0.0)
    assert Welcome in kinds(out)
    assert cp.nodes["n1"].inventory == inv


def test_an_undecodable_request_is_answered_with_the_reason() -> None:
    cp = ControlPlane(config=CONFIG, authorized=keyset(**{ADMIN: ("admin", "ops")}))
    bad = msgpack.packb({"kind": "request", "protocol": PROTOCOL_VERSION, "request_id": "q7",
                         "op": {"op": "scale", "name": "d", "replicas": "many"}})
    out = cp.handle(b"a", ADMIN, bad, 0.0)
    assert len(out) == 1
    reply = out[0][1]
    assert isinstance(reply, Reply) and reply.request_id == "q7" and not reply.ok
    assert "bad request message" in reply.error


def test_ports_reported_in_conflict_are_kept_on_the_node_until_hello() -> None:
    cp = ControlPlane(config=CONFIG, authorized=keyset(**{OLD: ("node", "n1")}))
    cp.desired_ids = lambda node_id: {"d-0"}
    at_hello = (EngineReport("adopted-0", 1, EngineState.EXITED, conflict_port=20007),)
    cp.handle(b"r", OLD, hello(engines=at_hello), 0.0)
    assert set(cp.nodes["n1"].conflict_ports) == {20007}
    conflict = EngineReport("d-0", 1, EngineState.EXITED, conflict_port=20001,
                            reason="not started: port 20001 is in use by pid 1 (x)")
    cp.handle(b"r", OLD, codec.encode(EngineChanged(conflict)), 1.0)
    assert set(cp.nodes["n1"].conflict_ports) == {20001, 20007}
    cp.handle(b"r", OLD, hello(), 2.0)
    assert cp.nodes["n1"].conflict_ports == {}


def test_a_silent_node_heard_again_is_reported_back_once() -> None:
    """No tick says a suspect node is ready again: the hook does, so that passes, which
    look only at nodes they are told changed, see it."""
    cp = ControlPlane(config=CONFIG, authorized=keyset(**{OLD: ("node", "n1")}))
    back: list[tuple[str, float]] = []
    cp.on_back = lambda node, now: back.append((node.node_id, now))
    cp.handle(b"n", OLD, hello(), 0.0)
    cp.handle(b"n", OLD, codec.encode(Heartbeat(1)), 1.0)
    assert back == []  # ready all along
    cp.tick(100.0)
    assert cp.nodes["n1"].state != "ready"
    cp.handle(b"n", OLD, codec.encode(Heartbeat(2)), 101.0)
    cp.handle(b"n", OLD, codec.encode(Heartbeat(3)), 102.0)
    assert back == [("n1", 101.0)]


async def test_a_node_is_written_to_the_store_only_when_it_changed(tmp_path: Any) -> None:
    """Every agent says Hello again after a restart, mostly with what it said before: an
    unchanged node is not written again, a changed one is, and what is stored is what
    the server knows (issue 12)."""
    from llmgw.server.orchestrator import Orchestrator
    from llmgw.server.store.sql import Store

    keys = keyset(**{OLD: ("node", "n1")})
    gpu = Gpu(0, "GPU-0", "H100", 81920, 81000, "00000000:01:00.0", nvlink_peers={"GPU-1": 18})

    def node_hello(addr: str = "10.0.0.1", gpus: tuple[Gpu, ...] = ()) -> bytes:
        return codec.encode(Hello(PROTOCOL_VERSION, NodeInfo("n1", addr), Inventory(gpus=gpus)))

    def start(store: Store) -> tuple[ControlPlane, Orchestrator, list[int]]:
        cp = ControlPlane(config=CONFIG, authorized=keys)
        orch = Orchestrator(cp, store, CONFIG, 0.0)
        writes: list[int] = []
        put = store.put_nodes

        def counting(rows: Any) -> None:
            rows = list(rows)
            writes.append(len(rows))
            put(rows)

        store.put_nodes = counting  # type: ignore[method-assign]
        return cp, orch, writes

    path = str(tmp_path / "state.db")
    store = Store(path)
    cp, orch, writes = start(store)
    cp.handle(b"a", OLD, node_hello(gpus=(gpu,)), 1.0)
    await orch._write_nodes()
    assert writes == [1]
    cp.handle(b"a", OLD, node_hello(gpus=(gpu,)), 2.0)  # the same again
    await orch._write_nodes()
    assert writes == [1]
    cp.handle(b"a", OLD, node_hello("10.0.0.2", gpus=(gpu,)), 3.0)  # info changed
    await orch._write_nodes()
    assert writes == [1, 1]
    # Changed and changed back before the next pass: nothing to write.
    cp.handle(b"a", OLD, node_hello("10.0.0.9", gpus=(gpu,)), 4.0)
    cp.handle(b"a", OLD, node_hello("10.0.0.2", gpus=(gpu,)), 4.5)
    await orch._write_nodes()
    assert writes == [1, 1]
    store.close()

    # A restart: the node says Hello with what the store holds, then with a new GPU.
    store = Store(path)
    cp, orch, writes = start(store)
    cp.handle(b"b", OLD, node_hello("10.0.0.2", gpus=(gpu,)), 10.0)
    await orch._write_nodes()
    assert writes == []
    gpu1 = Gpu(1, "GPU-1", "H100", 81920, 81000, "00000000:02:00.0", nvlink_peers={"GPU-0": 18})
    cp.handle(b"b", OLD, node_hello("10.0.0.2", gpus=(gpu, gpu1)), 11.0)
    await orch._write_nodes()
    assert writes == [1]
    stored = store.nodes()["n1"]
    assert stored.info == cp.nodes["n1"].info and stored.inventory == cp.nodes["n1"].inventory
    assert len(stored.inventory.gpus) == 2
    store.close()

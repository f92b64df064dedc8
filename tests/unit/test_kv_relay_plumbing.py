"""The plumbing that lets routers find and trust an agent's KV-event relay: the agent
advertises its relay in Hello, the server keeps it with the node and hands it on in the
endpoint table with the node's public key, and tells agents which router keys may follow."""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgpack
import pytest
import trio
from attrs import define, evolve, field

from llmgw import PROTOCOL_VERSION
from llmgw.agent.kvevents.routers import AuthorizedRouters
from llmgw.agent.link import LinkHooks, LinkSettings, serve_link
from llmgw.agent.run import kv_relay_endpoint, node_info
from llmgw.config.agent import AgentConfig, KeysConfig
from llmgw.config.server import ServerConfig
from llmgw.errors import ProtocolError
from llmgw.model.deployment import Deployment, Member, Replica, ReplicaState
from llmgw.model.engine import EngineKind, EngineReport
from llmgw.model.inventory import Inventory, NodeInfo
from llmgw.model.node import NodeState
from llmgw.server.endpoints import endpoint_table, table, without_keys
from llmgw.server.peers.service import run_plane
from llmgw.server.peers.sessions import ControlPlane, Outgoing
from llmgw.server.store.sql import Store, StoredNode
from llmgw.transport import codec
from llmgw.transport.codec import structure_result
from llmgw.transport.keys import KeyInfo
from llmgw.transport.messages import (
    DesiredSet,
    Heartbeat,
    Hello,
    HelloFirst,
    Message,
    Refused,
    RouterKeys,
    Welcome,
)
from llmgw.transport.requests import EndpointsResult, KvRelay
from llmgw.transport.zap import user_id

CONFIG = ServerConfig(heartbeat_interval=5.0)
NODE_KEY = "K" * 40


def agent_config(mgmt_addr: str = "10.0.0.11", port: int = 7444) -> AgentConfig:
    return AgentConfig(node_id="n1", server="tcp://10.0.0.9:7443", keys=KeysConfig("s", "p"),
                       mgmt_addr=mgmt_addr, kv_relay_port=port)


def plane() -> ControlPlane:
    return ControlPlane(config=CONFIG, authorized={NODE_KEY: KeyInfo("n1", "node", NODE_KEY.encode())})


def hello(relay: str) -> bytes:
    return codec.encode(Hello(PROTOCOL_VERSION, NodeInfo("n1", "10.0.0.1", kv_relay=relay), Inventory()))


# ---- the agent's Hello ----


@pytest.mark.parametrize(("addr", "port", "want"), [
    ("10.0.0.11", 7444, "tcp://10.0.0.11:7444"),
    ("gpu-a-01.internal", 9000, "tcp://gpu-a-01.internal:9000"),
    ("fd00::11", 7444, "tcp://[fd00::11]:7444"),
    ("[fd00::11]", 7444, "tcp://[fd00::11]:7444"),
    ("10.0.0.11", 0, ""),
])
def test_the_agent_advertises_its_relay_on_mgmt_addr_or_none(addr: str, port: int, want: str) -> None:
    cfg = agent_config(addr, port)
    assert kv_relay_endpoint(cfg) == want
    assert node_info(cfg).kv_relay == want


def test_a_hello_without_a_relay_is_on_the_wire_as_before() -> None:
    data = hello("")
    assert b"kv_relay" not in data
    assert codec.decode(data) == Hello(PROTOCOL_VERSION, NodeInfo("n1", "10.0.0.1"), Inventory())
    with_relay = codec.decode(hello("tcp://10.0.0.1:7444"))
    assert isinstance(with_relay, Hello) and with_relay.node.kv_relay == "tcp://10.0.0.1:7444"


def test_a_hello_from_an_agent_before_the_relay_decodes_with_none() -> None:
    # What an agent from before sends: NodeInfo's fields of then, and nothing else.
    raw = {"kind": "hello", "protocol": PROTOCOL_VERSION, "inventory": {},
           "node": {"node_id": "n1", "mgmt_addr": "10.0.0.1", "mgmt_interface": "",
                    "labels": {}, "port_range": [20000, 29999]}}
    msg = codec.decode(msgpack.packb(raw, use_bin_type=True))
    assert isinstance(msg, Hello) and msg.node.kv_relay == ""


def test_the_server_keeps_the_relay_with_the_node() -> None:
    cp = plane()
    assert Welcome in [type(m) for _, m in cp.handle(b"r", NODE_KEY, hello("tcp://10.0.0.1:7444"), 0.0)]
    assert cp.nodes["n1"].info.kv_relay == "tcp://10.0.0.1:7444"
    # Said again without one (kv_relay_port set to 0): gone.
    cp.handle(b"r", NODE_KEY, hello(""), 1.0)
    assert cp.nodes["n1"].info.kv_relay == ""


@pytest.mark.parametrize("bad", ["http://10.0.0.1:7444", "tcp://10.0.0.1", "tcp://a b:1", "x" * 5000])
def test_a_relay_address_no_router_could_dial_costs_the_relay_not_the_node(bad: str) -> None:
    cp = plane()
    assert Welcome in [type(m) for _, m in cp.handle(b"r", NODE_KEY, hello(bad), 0.0)]
    assert cp.nodes["n1"].info.kv_relay == ""
    assert cp.refusals["bad_kv_relay"] == 1


def test_the_store_keeps_the_relay_and_reads_rows_from_before_it(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    info = NodeInfo("n1", "10.0.0.1", kv_relay="tcp://10.0.0.1:7444")
    with Store(path) as s:
        s.put_node(info, Inventory(), 1.0)
        s.put_node(NodeInfo("n2", "10.0.0.2"), Inventory(), 1.0)
    # n2's row as llmgw before the relay wrote it: no kv_relay key at all.
    db = sqlite3.connect(path)
    row = json.loads(db.execute("SELECT info FROM nodes WHERE id = 'n2'").fetchone()[0])
    row.pop("kv_relay", None)
    with db:
        db.execute("UPDATE nodes SET info = ? WHERE id = 'n2'", (json.dumps(row),))
    db.close()
    with Store(path) as s:
        assert s.nodes()["n1"].info == info
        assert s.nodes()["n2"].info.kv_relay == ""


# ---- router keys: server -> agent ----

ROUTER_A = "a" * 40
ROUTER_B = "b" * 40
ADMIN = "d" * 40
NODE2_KEY = "M" * 40


def keys(**more: tuple[str, str]) -> dict[str, KeyInfo]:
    base = {NODE_KEY: ("node", "n1"), NODE2_KEY: ("node", "n2"), ROUTER_A: ("router", "ra"),
            ADMIN: ("admin", "ops")}
    base.update(more)
    return {k: KeyInfo(name, role, k.encode()) for k, (role, name) in base.items()}


def node_hello(node_id: str, relay: str) -> bytes:
    return codec.encode(Hello(PROTOCOL_VERSION, NodeInfo(node_id, "10.0.0.1", kv_relay=relay), Inventory()))


def test_an_agent_with_a_relay_gets_the_router_keys_right_after_welcome() -> None:
    cp = ControlPlane(config=CONFIG, authorized=keys())
    out = cp.handle(b"r1", NODE_KEY, node_hello("n1", "tcp://10.0.0.1:7444"), 0.0)
    assert [type(m) for _, m in out][:2] == [Welcome, RouterKeys]
    assert out[1] == (b"r1", RouterKeys((ROUTER_A,)))


def test_an_agent_without_a_relay_never_gets_router_keys() -> None:
    # An agent from before the relay (or with kv_relay_port 0) would log each as a bad message.
    cp = ControlPlane(config=CONFIG, authorized=keys())
    out = cp.handle(b"r2", NODE2_KEY, node_hello("n2", ""), 0.0)
    assert RouterKeys not in [type(m) for _, m in out]
    assert cp.set_authorized(keys(**{ROUTER_B: ("router", "rb")})) == []


def test_a_router_key_issued_or_revoked_reaches_every_relay_and_nothing_else_does() -> None:
    cp = ControlPlane(config=CONFIG, authorized=keys())
    cp.handle(b"r1", NODE_KEY, node_hello("n1", "tcp://10.0.0.1:7444"), 0.0)
    cp.handle(b"r2", NODE2_KEY, node_hello("n2", ""), 0.0)
    issued = keys(**{ROUTER_B: ("router", "rb")})
    assert cp.set_authorized(issued) == [(b"r1", RouterKeys((ROUTER_A, ROUTER_B)))]
    # Another node or admin key changes nothing a relay needs: nothing sent.
    assert cp.set_authorized({**issued, **keys(**{"e" * 40: ("admin", "ops2")})}) == []
    revoked = {k: v for k, v in cp.authorized.items() if k != ROUTER_A}
    assert cp.set_authorized(revoked) == [(b"r1", RouterKeys((ROUTER_B,)))]
    # The relay's own node revoked: its session is cut, no keys follow.
    without_node = {k: v for k, v in revoked.items() if k != NODE_KEY}
    out = cp.set_authorized({**without_node, "f" * 40: KeyInfo("rf", "router", b"f" * 40)})
    assert [type(m) for _, m in out] == [Refused]


def test_authorized_routers_swap_the_whole_set() -> None:
    routers = AuthorizedRouters()
    assert not routers.received and not routers.allows(ROUTER_A.encode())
    assert routers.lookup(ROUTER_A.encode()) is None
    routers.update((ROUTER_A, ROUTER_B))
    assert routers.received and routers.allows(ROUTER_A.encode()) and routers.allows(ROUTER_B.encode())
    info = routers.lookup(ROUTER_A.encode())
    assert info is not None and info.role == "router" and user_id(info) == ROUTER_A
    routers.update((ROUTER_B, "short", "x y" * 20))  # values that are no z85 key match nothing
    assert not routers.allows(ROUTER_A.encode()) and routers.keys == frozenset({ROUTER_B.encode()})
    routers.update(())
    assert routers.received and not routers.allows(ROUTER_B.encode())


class _MemNet:
    """The server's transport and one agent's connection, in memory (trio's clock)."""

    def __init__(self, uid: str) -> None:
        self.uid = uid
        self.to_server_send, self.to_server = trio.open_memory_channel[tuple[bytes, str, bytes]](math.inf)
        self.to_agent_send, self.to_agent = trio.open_memory_channel[bytes](math.inf)
        self.up = True

    async def recv_batch(self) -> list[tuple[bytes, str, bytes]]:
        return [await self.to_server.receive()]

    def send_all(self, out: list[Outgoing]) -> None:
        for _, msg in out:
            if self.up:
                self.to_agent_send.send_nowait(codec.encode(msg))

    async def send(self, payload: bytes) -> None:
        await trio.lowlevel.checkpoint()
        if self.up:
            self.to_server_send.send_nowait((b"agent", self.uid, payload))

    async def recv(self) -> bytes:
        return await self.to_agent.receive()

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[_MemNet]:
        yield self


async def test_the_link_keeps_the_agents_authorized_routers_as_the_server_says(
        autojump_clock: trio.testing.MockClock) -> None:
    net = _MemNet(NODE_KEY)
    cp = ControlPlane(config=CONFIG, authorized=keys())
    routers = AuthorizedRouters()
    hello_ = Hello(PROTOCOL_VERSION, node_info(agent_config()), Inventory())

    async def on_desired(_: DesiredSet) -> None:
        return None

    hooks = LinkHooks(hello=lambda: evolve(hello_, node=evolve(hello_.node, node_id="n1")),
                      on_desired=on_desired, on_router_keys=routers.update)
    _, outbox = trio.open_memory_channel[Message](10)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_plane, cp, net)
        nursery.start_soon(serve_link, LinkSettings(5.0, 1.0, 30.0), net.connect, hooks, outbox)
        await trio.sleep(1)
        assert routers.keys == frozenset({ROUTER_A.encode()})
        net.send_all(cp.set_authorized(keys(**{ROUTER_B: ("router", "rb")})))
        await trio.sleep(1)
        assert routers.allows(ROUTER_B.encode())
        # The server away: the last set stays, so routers keep following while engines serve.
        net.up = False
        await trio.sleep(60)
        assert routers.keys == frozenset({ROUTER_A.encode(), ROUTER_B.encode()})
        nursery.cancel_scope.cancel()


# ---- the endpoint table ----

RELAY = "tcp://10.0.0.1:7444"
KV_D = Deployment(name="kv", model="org/m", engine=EngineKind.VLLM, gpus_per_node=1, replicas=1,
                  kv_events=True)


@define
class Side:
    state: NodeState
    info: NodeInfo
    key: str = NODE_KEY
    engines: dict[str, EngineReport] = field(factory=dict)


def kv_replica(spec: Deployment = KV_D, *nodes: str) -> Replica:
    members = tuple(Member(n, i, ("GPU-0",), 8000, addr="10.0.0.1") for i, n in enumerate(nodes or ("n1",)))
    return Replica(f"{spec.name}-0", spec.name, 0, spec, state=ReplicaState.READY, members=members)


def row(replicas: list[Replica], nodes: dict[str, Side]) -> dict[str, object]:
    got = endpoint_table({r.id: r for r in replicas}, nodes)
    (rows,) = got.values()
    return rows[0]


def test_a_kv_events_replica_names_its_head_agents_relay_and_key() -> None:
    relayed = {"n1": Side(NodeState.READY, NodeInfo("n1", "10.0.0.1", kv_relay=RELAY))}
    assert row([kv_replica()], relayed)["kv"] == {"endpoint": RELAY, "key": NODE_KEY}
    # A gang: the head's relay (the scheduler's rank runs there), never a member's.
    gang = {**relayed, "n2": Side(NodeState.READY, NodeInfo("n2", "10.0.0.2", kv_relay="tcp://10.0.0.2:7444"),
                                  key=NODE2_KEY)}
    assert row([kv_replica(KV_D, "n1", "n2")], gang)["kv"] == {"endpoint": RELAY, "key": NODE_KEY}
    # A suspect head keeps its row and its relay: the router judges by what answers.
    suspect = {"n1": evolve(relayed["n1"], state=NodeState.SUSPECT)}
    assert row([kv_replica()], suspect)["kv"] == {"endpoint": RELAY, "key": NODE_KEY}


@pytest.mark.parametrize("why", ["kv_events off", "no relay advertised", "no key known"])
def test_no_kv_where_nothing_is_relayed(why: str) -> None:
    spec, info, key = KV_D, NodeInfo("n1", "10.0.0.1", kv_relay=RELAY), NODE_KEY
    if why == "kv_events off":
        spec = evolve(KV_D, kv_events=False)
    elif why == "no relay advertised":
        info = NodeInfo("n1", "10.0.0.1")
    else:
        key = ""
    assert "kv" not in row([kv_replica(spec)], {"n1": Side(NodeState.READY, info, key)})


def test_the_router_reads_kv_and_ctl_sees_it_too() -> None:
    relayed = {"n1": Side(NodeState.READY, NodeInfo("n1", "10.0.0.1", kv_relay=RELAY))}
    t = {"version": 3, **table({"kv": KV_D}, {"kv-0": kv_replica()}, {}, relayed)}
    result = structure_result(t, EndpointsResult)
    assert result.models["org/m"][0].kv == KvRelay(RELAY, NODE_KEY)
    plain = structure_result({"version": 3, "models": {"org/m": [{"replica_id": "r", "url": "http://h:1"}]}},
                             EndpointsResult)
    assert plain.models["org/m"][0].kv is None
    # Public keys are no secret: an admin's view keeps them.
    assert without_keys(t)["models"]["org/m"][0]["kv"] == {"endpoint": RELAY, "key": NODE_KEY}


@pytest.mark.parametrize("kv", [{"endpoint": "http://10.0.0.1:7444", "key": NODE_KEY},
                                {"endpoint": RELAY, "key": "short"},
                                {"endpoint": RELAY},
                                {"endpoint": RELAY, "key": NODE_KEY, "more": 1}])
def test_a_bad_kv_from_a_server_is_a_protocol_error(kv: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        structure_result({"version": 1, "models": {"m": [{"replica_id": "r", "url": "http://h:1", "kv": kv}]}},
                         EndpointsResult)


def test_a_node_remembered_after_a_restart_keeps_its_relay_key() -> None:
    # Before its agent's Hello again: the node key authorized under its name, so that the
    # routers' links to its relay survive the server's restart.
    cp = ControlPlane(config=CONFIG, authorized=keys())
    stored = {"n1": StoredNode(info=NodeInfo("n1", "10.0.0.1", kv_relay=RELAY), inventory=Inventory(),
                               cordoned=False, draining=False, last_seen=0.0),
              "n9": StoredNode(info=NodeInfo("n9", "10.0.0.9"), inventory=Inventory(),
                               cordoned=False, draining=False, last_seen=0.0)}
    cp.remember(stored, 10.0)
    assert cp.nodes["n1"].key == NODE_KEY and cp.nodes["n9"].key == ""
    assert not cp.nodes["n1"].connected
    # Which takes no message of that key before a Hello.
    assert [type(m) for _, m in cp.handle(b"r", NODE_KEY, codec.encode(Heartbeat(1)), 11.0)] == [HelloFirst]
    assert row([kv_replica()], dict(cp.nodes))["kv"] == {"endpoint": RELAY, "key": NODE_KEY}  # type: ignore[arg-type]


# ---- llmgw dev ----


def test_devs_agent_relays_on_a_free_port_kept_with_the_folder(tmp_path: Path) -> None:
    from llmgw import dev_config
    from llmgw.config.load_agent import load_agent_config

    opts = dev_config.DevOptions(state_dir=str(tmp_path))
    first = load_agent_config(str(dev_config.write_configs(tmp_path, opts, 8080).agent_yaml))
    assert first.kv_relay_port not in (0, 7444)  # a second dev, or one beside a real agent, starts
    lo, hi = first.port_range
    assert not lo <= first.kv_relay_port <= hi
    again = load_agent_config(str(dev_config.write_configs(tmp_path, opts, 8080).agent_yaml))
    assert again.kv_relay_port == first.kv_relay_port


# ---- what ctl shows ----


def test_ctl_describe_shows_where_kv_events_are_relayed() -> None:
    from llmgw.ctl.render import render

    dep = {"name": "kv", "model": "org/m", "served_name": "org/m", "engine": "vllm", "ready": 2,
           "replicas": 2, "status": "ready", "spec": {"kv_events": True}, "replica_list": [],
           "events": [], "kv_relays": {"kv-0": RELAY, "kv-1": ""}}
    text = render("describe", "deployment", dep)
    assert f"KV events of kv-0: relayed at {RELAY}" in text
    assert "KV events of kv-1: not relayed (its head node's agent has no relay" in text
    assert "KV events" not in render("describe", "deployment", {**dep, "kv_relays": None})
    node = {"id": "n1", "state": "ready", "connected": True, "heartbeat_age": 1.0, "mgmt_addr": "10.0.0.1",
            "kv_relay": RELAY}
    assert f"KV relay:  {RELAY}" in render("describe", "node", node)
    assert "KV relay:  none" in render("describe", "node", {**node, "kv_relay": ""})


def test_the_server_names_each_placed_replicas_relay_and_each_nodes() -> None:
    from types import SimpleNamespace

    from llmgw.server.status import kv_relays, node_view

    cp = plane()
    cp.handle(b"r", NODE_KEY, hello(RELAY), 0.0)
    placed, unplaced = kv_replica(), evolve(kv_replica(), id="kv-1", members=())
    elsewhere = evolve(kv_replica(KV_D, "n7"), id="kv-2")  # a node the server has not heard
    o = SimpleNamespace(cp=cp)
    assert kv_relays(o, [placed, unplaced, elsewhere]) == {"kv-0": RELAY, "kv-2": ""}
    assert node_view(cp.nodes["n1"], 1.0)["kv_relay"] == RELAY

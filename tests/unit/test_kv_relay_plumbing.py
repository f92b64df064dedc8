"""The plumbing that lets routers find and trust an agent's KV-event relay: the agent
advertises its relay in Hello, the server keeps it with the node and hands it on in the
endpoint table with the node's public key, and tells agents which router keys may follow."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import msgpack
import pytest

from llmgw import PROTOCOL_VERSION
from llmgw.agent.run import kv_relay_endpoint, node_info
from llmgw.config.agent import AgentConfig, KeysConfig
from llmgw.config.server import ServerConfig
from llmgw.model.inventory import Inventory, NodeInfo
from llmgw.server.peers.sessions import ControlPlane
from llmgw.server.store.sql import Store
from llmgw.transport import codec
from llmgw.transport.keys import KeyInfo
from llmgw.transport.messages import Hello, Welcome

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

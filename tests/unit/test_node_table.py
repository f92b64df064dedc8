"""The node table has one owner: ControlPlane (server/peers/sessions.py). Others read it
through `nodes`, a read-only view, and change it only through its methods (checked on the
source, with ast: no `._nodes` anywhere else)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from llmgw import PROTOCOL_VERSION
from llmgw.config.server import ServerConfig
from llmgw.model.inventory import Inventory, NodeInfo
from llmgw.model.node import NodeState
from llmgw.server.peers.sessions import ControlPlane, Node
from llmgw.server.store.sql import StoredNode
from llmgw.transport import codec
from llmgw.transport.keys import KeyInfo
from llmgw.transport.messages import Heartbeat, Hello

KEY = "k" * 40

ROOT = Path(__file__).resolve().parents[2]
OWNER = ROOT / "src" / "llmgw" / "server" / "peers" / "sessions.py"
PRIVATE = {"_nodes", "_nodes_view"}


def test_only_the_control_plane_touches_its_table() -> None:
    files = [p for d in ("src", "tests", "bench") for p in sorted((ROOT / d).rglob("*.py")) if p != OWNER]
    assert len(files) > 100
    found = [f"{p.relative_to(ROOT)}:{node.lineno}"
             for p in files for node in ast.walk(ast.parse(p.read_text(), str(p)))
             if isinstance(node, ast.Attribute) and node.attr in PRIVATE]
    assert found == []


def test_the_view_is_read_only_and_live() -> None:
    cp = ControlPlane(config=ServerConfig())
    view = cp.nodes
    with pytest.raises(TypeError):
        view["n1"] = None  # type: ignore[index]
    assert "n1" not in view and not hasattr(view, "clear")
    node = Node("n1", NodeInfo("n1", "10.0.0.1"), Inventory(), NodeState.SUSPECT, 0.0, b"")
    cp.seed(node)
    assert view["n1"] is node and list(view) == ["n1"]


CONFIG = ServerConfig(heartbeat_interval=5.0, suspect_after_missed=3, lost_after=60.0, restart_grace=300.0)


def _hello(cp: ControlPlane, now: float) -> None:
    cp.handle(b"r", KEY, codec.encode(Hello(PROTOCOL_VERSION, NodeInfo("n1", "10.0.0.1"), Inventory())), now)


def test_a_node_first_heard_is_born_ready() -> None:
    cp = ControlPlane(config=CONFIG, authorized={KEY: KeyInfo("n1", "node", b"")})
    _hello(cp, 10.0)
    node = cp.nodes["n1"]
    assert (node.state, node.silent_since, node.last_seen) == (NodeState.READY, None, 10.0)


def test_remembered_nodes_are_born_suspect_with_the_restart_grace() -> None:
    """The store's nodes after a restart: suspect, silent since the restart, and not lost
    before the restart grace ends however long they stay silent."""
    cp = ControlPlane(config=CONFIG)
    cp.remember({"n1": StoredNode(NodeInfo("n1", "10.0.0.1"), Inventory(), cordoned=True)}, 100.0)
    node = cp.nodes["n1"]
    assert (node.state, node.silent_since, node.connected, node.cordoned) == (
        NodeState.SUSPECT, 100.0, False, True)
    cp.tick(399.0)  # silent 299 s: past lost_after, within the restart grace
    assert node.state == NodeState.SUSPECT
    cp.tick(400.0)
    assert (node.state, node.silent_since) == (NodeState.LOST, 100.0)


def test_the_owner_keeps_silent_since() -> None:
    """Set to the last time heard when the node goes silent, kept through lost, cleared
    when it is heard again: by the node table's owner, with no callback needed."""
    cp = ControlPlane(config=CONFIG, authorized={KEY: KeyInfo("n1", "node", b"")})
    _hello(cp, 10.0)
    node = cp.nodes["n1"]
    cp.tick(20.0)
    assert (node.state, node.silent_since) == (NodeState.READY, None)
    cp.tick(25.0)  # silent 15 s: three heartbeats missed
    assert (node.state, node.silent_since) == (NodeState.SUSPECT, 10.0)
    cp.tick(70.0)
    assert (node.state, node.silent_since) == (NodeState.LOST, 10.0)
    cp.handle(b"r", KEY, codec.encode(Heartbeat(seq=1)), 80.0)
    assert (node.state, node.silent_since) == (NodeState.READY, None)

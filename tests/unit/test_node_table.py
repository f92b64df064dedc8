"""The node table has one owner: ControlPlane (server/peers/sessions.py). Others read it
through `nodes`, a read-only view, and change it only through its methods (checked on the
source, with ast: no `._nodes` anywhere else)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from llmgw.config.server import ServerConfig
from llmgw.model.inventory import Inventory, NodeInfo
from llmgw.model.node import NodeState
from llmgw.server.peers.sessions import ControlPlane, Node

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

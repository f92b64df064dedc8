"""The pure cores stay pure: no trio, zmq, os, time, socket or subprocess in them, nor in
any llmgw module they import, nor in the packages' `__init__.py` that importing them runs
(checked on the source, with ast, transitively)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
FORBIDDEN = {"trio", "zmq", "os", "time", "socket", "subprocess", "threading", "asyncio"}
PURE = [
    "llmgw.server.placement.place",
    "llmgw.server.placement.cluster_view",
    "llmgw.server.placement.gpu_pick",
    "llmgw.server.reconcile.state",
    "llmgw.server.reconcile.rules",
    "llmgw.server.reconcile.passes",
    "llmgw.server.reconcile.rollout",
    "llmgw.server.reconcile.adapters",
    "llmgw.server.reconcile.replica_states",
    "llmgw.server.reconcile.rebuild",
    "llmgw.server.peers.node_states",
    "llmgw.agent.lifecycle.converge",
    "llmgw.agent.lora.adapters",
    "llmgw.agent.lifecycle.bad_copies",
    "llmgw.agent.lifecycle.states",
    "llmgw.agent.engines.vllm",
    "llmgw.agent.engines.sglang",
    "llmgw.agent.engines.ray",
    "llmgw.agent.engines.simulated",
    "llmgw.agent.engines.plan",
    "llmgw.agent.engines.build",
    "llmgw.agent.engines.keys",
    "llmgw.agent.engines",
    "llmgw.agent.engines.env",
    "llmgw.config.vllm_serve",
    "llmgw.agent.discovery.nvidia_smi",
    "llmgw.agent.discovery.mountinfo",
    "llmgw.agent.discovery.procnet",
    "llmgw.agent.discovery.engine_meta",
    "llmgw.agent.discovery.gpu_health",
    "llmgw.agent.gpus.claims",
    "llmgw.agent.gpus.release",
    "llmgw.agent.lifecycle.startup_deadline",
    "llmgw.model.gpu_need",
    "llmgw.model.affinity",
    "llmgw.model.preflight",
    "llmgw.agent.engines.preflight",
    "llmgw.server.placement.fabrics",
    "llmgw.model.autoscale",
    "llmgw.model.apikey",
    "llmgw.model.usage",
    "llmgw.model.leases",
    "llmgw.model.pcie",
    "llmgw.server.tenants.leases",
    "llmgw.router.tenants.wallet",
    "llmgw.server.tenants.slots",
    "llmgw.router.tenants.slots",
    "llmgw.server.elastic.decide",
    "llmgw.server.elastic.load_board",
    "llmgw.server.placement.preempt",
    "llmgw.model.affinity",
    "llmgw.model.deployment",
    "llmgw.model.engine",
    "llmgw.model.inventory",
    "llmgw.model.node",
    "llmgw.http1.grammar",
    "llmgw.http1.chunked",
    "llmgw.http1.request",
    "llmgw.http1.response",
    "llmgw.http1.listen",
    "llmgw.transport.messages",
    "llmgw.transport.requests",
    "llmgw.server.placement.fabrics",
    "llmgw.server.peers.intern",
    "llmgw.router.connection.jsondepth",
    "llmgw.server.endpoints",
]


def _path(module: str) -> Path:
    base = SRC.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _imports(module: str) -> set[str]:
    """Every module `module` imports (absolute names; relative ones resolved)."""
    tree = ast.parse(_path(module).read_text(), str(_path(module)))
    package = module if _path(module).name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            out.add(name)
            # `from llmgw.x import y` may import the module llmgw.x.y
            out.update(f"{name}.{a.name}" for a in node.names if _path(f"{name}.{a.name}").exists()
                       and name.startswith("llmgw"))
    return out


def _closure(module: str) -> dict[str, str]:
    """Forbidden top-level module -> the llmgw module that imports it, over every llmgw
    module reachable from `module`."""
    seen: set[str] = set()
    todo = [module]
    bad: dict[str, str] = {}
    while todo:
        m = todo.pop()
        if m in seen or not _path(m).exists():
            continue
        seen.add(m)
        # Importing a.b.c runs a/__init__.py and a/b/__init__.py first.
        parts = m.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        for name in _imports(m):
            top = name.split(".")[0]
            if top in FORBIDDEN:
                bad.setdefault(top, m)
            elif top == "llmgw":
                todo.append(name)
    return bad


@pytest.mark.parametrize("module", PURE)
def test_pure_core_imports_no_io(module: str) -> None:
    assert _path(module).exists(), module
    assert _closure(module) == {}


def test_the_check_would_see_io() -> None:
    assert "trio" in _closure("llmgw.agent.discovery.discover")
    assert "subprocess" in _closure("llmgw.agent.discovery.gpus")
    assert "trio" in _closure("llmgw.http1.serve")  # the shell beside the pure modules


def test_the_check_counts_the_packages_a_module_is_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pure leaf in a package whose __init__.py loads trio is not pure to import.
    pkg = tmp_path / "llmgw" / "pkg"
    pkg.mkdir(parents=True)
    (tmp_path / "llmgw" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from llmgw.pkg.shell import run\n")
    (pkg / "shell.py").write_text("import trio\n")
    (pkg / "leaf.py").write_text("import re\n")
    monkeypatch.setitem(globals(), "SRC", tmp_path)  # what _path reads
    assert _closure("llmgw.pkg.leaf") == {"trio": "llmgw.pkg.shell"}

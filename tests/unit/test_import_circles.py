"""No import circle in src/llmgw (issue 21): every module's imports, read with ast
(module level and inside functions; importing a.b.c runs the package __init__ files of a
and a.b too), form a graph without cycles. Imports under `if TYPE_CHECKING:` are left out:
they never run, so they tie no modules together at import time. The server has no
circle even counting them: ops.py, gpu_clear.py and status.py read the cluster's state
through server/cluster.py, not the orchestrator, which no longer builds them."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for p in (SRC / "llmgw").rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, mods: dict[str, Path], typing_too: bool = False) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child) and not typing_too:
                for stmt in child.orelse:
                    visit(stmt)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.rsplit(".", child.level - 1)[0] if child.level > 1 else package
                    target = f"{base}.{child.module}" if child.module else base
                else:
                    target = child.module or ""
                found.add(target)
                found.update(f"{target}.{a.name}" for a in child.names if f"{target}.{a.name}" in mods)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    # Importing a.b.c runs a/__init__.py and a/b/__init__.py first.
    with_parents = set()
    for target in found:
        parts = target.split(".")
        with_parents.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {m for m in with_parents if m in mods and m != name and not name.startswith(m + ".")}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` as a path of modules, or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = walk(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state:
            found = walk(m)
            if found:
                return found
    return []


def test_no_import_circle_in_llmgw() -> None:
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert len(graph) > 100  # the whole package was read
    cycle = _cycle(graph)
    assert not cycle, " -> ".join(cycle)


def test_the_check_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_no_circle_in_the_server_even_in_type_hints() -> None:
    """ops, status and gpu_clear once named the Orchestrator that builds them (under
    TYPE_CHECKING): a circle in all but name. None is left, hints counted."""
    mods = _modules()
    graph = {m: {n for n in _imports(m, p, mods, typing_too=True) if n.startswith("llmgw.server")}
             for m, p in mods.items() if m.startswith("llmgw.server")}
    assert "llmgw.server.ops" in graph
    cycle = _cycle(graph)
    assert not cycle, " -> ".join(cycle)

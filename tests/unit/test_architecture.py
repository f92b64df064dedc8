"""The architecture, checked on the source: one import scanner (ast) and one declared layer
map, each rule a test that names the offending file, line and import.

- Floors: a room (a top-level package or module of llmgw) imports only rooms on lower
  floors. model/ imports nothing of llmgw, config/ imports model/, agent/, server/ and
  router/ share a floor so none imports another, and cli.py alone sits on top, knowing every
  part.
- Pure cores: the modules in PURE, every llmgw module they import and every package
  `__init__.py` importing them runs import no I/O (trio, zmq, os, time, resource, ...) and
  call no builtin open().
- HTTP/1.1 lives below the router: neither it nor the agent or the server loads a router
  module, so serving goes on while the server is away and the daemons' listener needs none
  of it.
- No import circle, at run time nor counting the imports under `if TYPE_CHECKING:` (a
  module that names in its hints one that imports it back is a circle in all but name).

Imports are read everywhere in a module (module level, functions, `if TYPE_CHECKING:`).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import attrs
import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# The layer map, lowest floor first. A room imports rooms on lower floors only; rooms on one
# floor never import each other. "llmgw" is the package's own face (llmgw/__init__.py).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("llmgw", "model", "errors", "backoff", "logbound", "rlimit"),  # leaves: nothing of llmgw
    ("config", "examples"),
    ("transport", "http1", "kvcache"),  # kvcache: KV-cache-aware routing's pure core
    ("agent", "server", "router", "simengine"),
    ("ctl",),  # reads the router's settings to print them
    ("dev_config",),  # dev's folder: options, keys, ports, config files (dev runs it)
    ("dev",),  # server, agent and router in one process
    ("cli",),  # the one module that knows every part
)
FLOOR = {room: n for n, rooms in enumerate(FLOORS) for room in rooms}

# Pairs the design names on their own, checked whatever the floors say: the agent and the
# server share only model/ and transport/, and the router serves while the server is away.
NEVER = (("agent", "server"), ("server", "agent"), ("router", "server"))

# What a pure module may not load, even through another llmgw module or a package's
# __init__.py: the event loop, sockets, processes, clocks, the OS, and rlimits.
FORBIDDEN = {"trio", "zmq", "os", "time", "socket", "subprocess", "threading", "asyncio",
             "resource", "signal", "shutil", "tempfile", "sqlite3", "pynvml", "psycopg"}

# The pure cores. `*` stands for any part of one name, so `folder.*` names every module of a
# folder (a new module there is pure or the test says so); `**` stands for any folders
# between, so a module that moves to a subfolder stays on the list. Every pattern must name
# at least one module.
PURE = (
    "llmgw.model",
    "llmgw.model.*",
    "llmgw.config.vllm_serve",
    "llmgw.server.placement.*",
    "llmgw.server.reconcile.*",
    "llmgw.server.peers.node_states",
    "llmgw.server.peers.intern",
    "llmgw.server.tenants.leases",
    "llmgw.server.tenants.slots",
    "llmgw.server.elastic.decide",
    "llmgw.server.elastic.load_board",
    "llmgw.server.endpoints",
    "llmgw.agent.engines",
    "llmgw.agent.engines.*",
    "llmgw.agent.discovery.nvidia_smi",
    "llmgw.agent.discovery.mountinfo",
    "llmgw.agent.discovery.procnet",
    "llmgw.agent.discovery.engine_meta",
    "llmgw.agent.discovery.gpu_health",
    "llmgw.agent.**.converge",
    "llmgw.agent.**.bad_copies",
    "llmgw.agent.**.startup_deadline",
    "llmgw.agent.**.*states",
    "llmgw.agent.**.adapters",
    "llmgw.agent.**.claims",
    "llmgw.agent.**.release",
    "llmgw.agent.kvevents.stream",
    "llmgw.agent.kvevents.relay",
    "llmgw.http1",
    "llmgw.http1.*",
    "llmgw.transport.messages",
    "llmgw.transport.requests",
    "llmgw.kvcache",
    "llmgw.kvcache.*",
    "llmgw.router.**.wallet",
    "llmgw.router.**.slots",
    "llmgw.router.**.jsondepth",
    "llmgw.router.**.fairqueue",
    "llmgw.router.**.resume",
    "llmgw.router.kv",
    "llmgw.router.kv.follow",
    "llmgw.router.**.classes",
    "llmgw.router.**.priority",
)

# The trio shells inside a pure folder, left out of PURE's patterns.
SHELLS = (
    "llmgw.http1.serve",  # the small listener on a port
    "llmgw.http1.client",  # a one-off GET
)

# Leaves whose whole import set is pinned: the GPU health table reads NVML's numbers into
# data types and nothing else, so the agent and the GPU check can share it.
PINNED = {
    "llmgw.agent.discovery.gpu_health": {"__future__", "attrs", "collections.abc",
                                         "llmgw.model.inventory"},
}

# Loaded by neither HTTP/1.1 nor the agent nor the server: no router module.
NO_ROUTER = ("llmgw.http1.serve", "llmgw.http1.client", "llmgw.agent.run",
             "llmgw.server.peers.service")


# ---------------------------------------------------------------------------------------------
# The scanner


@attrs.frozen
class Import:
    target: str  # an absolute module name (relative imports resolved)
    line: int
    runtime: bool  # False under `if TYPE_CHECKING:`


@attrs.frozen
class Source:
    root: Path  # the folder that holds llmgw/
    modules: dict[str, Path]
    imports: dict[str, tuple[Import, ...]]
    opens: dict[str, tuple[int, ...]]  # lines that call the builtin open()

    def where(self, module: str, line: int) -> str:
        return f"{self.modules[module].relative_to(self.root)}:{line}"


def _module_names(root: Path) -> dict[str, Path]:
    """Every module under root/llmgw by its dotted name. A module is its file: `web.py` is
    llmgw...web even beside a folder `web/` of assets (Python imports the file, as a folder
    without __init__.py is only a namespace package, found last)."""
    out = {}
    for p in sorted((root / "llmgw").rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _is_open(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Name) and f.id == "open") or (
        isinstance(f, ast.Attribute) and f.attr == "open" and isinstance(f.value, ast.Name)
        and f.value.id in ("builtins", "io"))


def _read(name: str, path: Path, modules: dict[str, Path]) -> tuple[list[Import], list[int]]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []
    opens: list[int] = []

    def visit(node: ast.AST, runtime: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for stmt in child.body:
                    visit(stmt, False)
                    _one(stmt, False)
                for stmt in child.orelse:
                    visit(stmt, runtime)
                    _one(stmt, runtime)
                continue
            _one(child, runtime)
            visit(child, runtime)

    def _one(node: ast.AST, runtime: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(a.name, node.lineno, runtime) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.append(Import(target, node.lineno, runtime))
            # `from llmgw.x import y` imports the module llmgw.x.y where there is one.
            found.extend(Import(f"{target}.{a.name}", node.lineno, runtime)
                         for a in node.names if f"{target}.{a.name}" in modules)
        elif isinstance(node, ast.Call) and _is_open(node):
            opens.append(node.lineno)

    visit(ast.parse(path.read_text(), str(path)), True)
    return found, opens


def scan(root: Path) -> Source:
    modules = _module_names(root)
    imports, opens = {}, {}
    for name, path in modules.items():
        found, calls = _read(name, path, modules)
        imports[name] = tuple(found)
        opens[name] = tuple(calls)
    return Source(root, modules, imports, opens)


@cache
def source() -> Source:
    return scan(SRC)


def _parents(module: str) -> list[str]:
    """Importing a.b.c runs a/__init__.py and a/b/__init__.py first."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def reach(src: Source, start: str) -> dict[str, str | None]:
    """Every llmgw module that importing `start` loads, each with the one that led to it."""
    came: dict[str, str | None] = {start: None}
    todo = [start]
    while todo:
        m = todo.pop()
        nexts = _parents(m) + [i.target for i in src.imports.get(m, ())]
        for n in nexts:
            if n in src.modules and n not in came:
                came[n] = m
                todo.append(n)
    return came


def _chain(came: dict[str, str | None], m: str) -> str:
    path = [m]
    while (prev := came[path[-1]]) is not None:
        path.append(prev)
    return " <- ".join(path)


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _pattern(pattern: str) -> re.Pattern[str]:
    rx = ""
    for part in pattern.split("."):
        if part == "**":
            rx += r"(?:[^.]+\.)*"
            continue
        rx += "[^.]*".join(re.escape(piece) for piece in part.split("*")) + r"\."
    return re.compile(rx.removesuffix(r"\.") + r"\Z")


def matching(patterns: Iterable[str], modules: Iterable[str]) -> dict[str, list[str]]:
    names = sorted(modules)
    return {p: [m for m in names if _pattern(p).match(m)] for p in patterns}


def pure_modules() -> list[str]:
    shells = {m for found in matching(SHELLS, source().modules).values() for m in found}
    return sorted({m for found in matching(PURE, source().modules).values() for m in found} - shells)


def impurities(src: Source, module: str) -> list[str]:
    """What makes `module` impure to import, each naming the file, line and the way there."""
    came = reach(src, module)
    bad = []
    for m in sorted(came):
        for i in src.imports[m]:
            if i.target.split(".")[0] in FORBIDDEN:
                bad.append(f"{src.where(m, i.line)} imports {i.target} ({_chain(came, m)})")
        bad.extend(f"{src.where(m, line)} calls open() ({_chain(came, m)})" for line in src.opens[m])
    return bad


def graph(src: Source, runtime_only: bool) -> dict[str, set[str]]:
    """Module -> the llmgw modules importing it loads (the packages they are in included),
    leaving out its own packages, which are loading already when it runs."""
    out = {}
    for m in src.modules:
        targets = {i.target for i in src.imports[m] if i.runtime or not runtime_only}
        loaded = {p for t in targets for p in [*_parents(t), t]}
        out[m] = {n for n in loaded if n in src.modules and n != m and not m.startswith(n + ".")}
    return out


def cycle(g: dict[str, set[str]]) -> list[str]:
    """One cycle of `g` as a path of modules, or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for n in sorted(g[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = walk(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return []

    for m in sorted(g):
        if m not in state:
            found = walk(m)
            if found:
                return found
    return []


# ---------------------------------------------------------------------------------------------
# Floors


def test_the_whole_package_was_read() -> None:
    src = source()
    assert len(src.modules) > 100
    assert "llmgw.server.web" in src.modules  # a module beside an asset folder of its name
    assert src.modules["llmgw.server.web"].name == "web.py"


def test_every_room_is_on_a_floor() -> None:
    rooms = {room(m) for m in source().modules}
    assert sorted(rooms - FLOOR.keys()) == []
    assert sorted(FLOOR.keys() - rooms) == []  # the map names no room that is gone


@pytest.mark.parametrize("name", sorted(FLOOR))
def test_room_imports_only_lower_floors(name: str) -> None:
    src = source()
    bad = [f"{src.where(m, i.line)} imports {i.target} ({room(i.target)}, floor "
           f"{FLOOR.get(room(i.target))}; {name} is on floor {FLOOR[name]})"
           for m in src.modules if room(m) == name
           for i in src.imports[m]
           if i.target.split(".")[0] == "llmgw" and room(i.target) != name
           and FLOOR.get(room(i.target), len(FLOORS)) >= FLOOR[name]]
    assert bad == []


def test_model_imports_nothing_of_llmgw() -> None:
    src = source()
    bad = [f"{src.where(m, i.line)} imports {i.target}" for m in src.modules if room(m) == "model"
           for i in src.imports[m] if i.target.split(".")[0] == "llmgw" and room(i.target) != "model"]
    assert bad == []


@pytest.mark.parametrize(("importer", "imported"), NEVER)
def test_rooms_that_never_import_each_other(importer: str, imported: str) -> None:
    src = source()
    bad = [f"{src.where(m, i.line)} imports {i.target}" for m in src.modules if room(m) == importer
           for i in src.imports[m] if i.target.split(".")[0] == "llmgw" and room(i.target) == imported]
    assert bad == []


def test_nothing_imports_the_cli() -> None:
    src = source()
    bad = [f"{src.where(m, i.line)} imports {i.target}" for m in src.modules
           for i in src.imports[m] if room(i.target) == "cli" and i.target.startswith("llmgw.")]
    assert bad == []


def test_the_floor_check_would_see_an_upward_import(tmp_path: Path) -> None:
    _tree(tmp_path, {"llmgw/__init__.py": "", "llmgw/model/__init__.py": "",
                     "llmgw/model/node.py": "from llmgw.config.server import X\n",
                     "llmgw/config/__init__.py": "", "llmgw/config/server.py": ""})
    src = scan(tmp_path)
    up = [i for i in src.imports["llmgw.model.node"]
          if FLOOR[room(i.target)] >= FLOOR[room("llmgw.model.node")]]
    assert [(i.target, i.line, src.where("llmgw.model.node", i.line)) for i in up] == [
        ("llmgw.config.server", 1, "llmgw/model/node.py:1")]


# ---------------------------------------------------------------------------------------------
# Pure cores


def test_every_pure_pattern_names_a_module() -> None:
    assert [p for p, found in matching(PURE + SHELLS, source().modules).items() if not found] == []


@pytest.mark.parametrize("module", pure_modules())
def test_pure_core_imports_no_io(module: str) -> None:
    assert impurities(source(), module) == []


@pytest.mark.parametrize("module", sorted(PINNED))
def test_pinned_leaf_imports_only_its_set(module: str) -> None:
    assert {i.target for i in source().imports[module]} <= PINNED[module]


def test_the_check_would_see_io() -> None:
    src = source()

    def tops(module: str) -> str:
        return " ".join(impurities(src, module))

    assert " imports trio " in tops("llmgw.agent.discovery.discover")
    assert " imports subprocess " in tops("llmgw.agent.discovery.gpus")
    assert " imports trio " in tops("llmgw.http1.serve")  # the shell beside the pure modules
    assert " imports resource " in tops("llmgw.rlimit")
    assert "llmgw/server/web.py" in tops("llmgw.server.peers.service")  # seen past its assets


def test_the_check_sees_open_and_the_packages_a_module_is_in(tmp_path: Path) -> None:
    # A pure leaf in a package whose __init__.py loads a shell is not pure to import.
    _tree(tmp_path, {"llmgw/__init__.py": "",
                     "llmgw/pkg/__init__.py": "from llmgw.pkg.shell import run\n",
                     "llmgw/pkg/shell.py": "import re\n\n\ndef run():\n    return open('x')\n",
                     "llmgw/pkg/leaf.py": "import re\n",
                     "llmgw/pkg/web.py": "from .leaf import x\nimport resource\n",
                     "llmgw/pkg/web/page.html": ""})
    src = scan(tmp_path)
    assert impurities(src, "llmgw.pkg.leaf") == [
        "llmgw/pkg/shell.py:5 calls open() (llmgw.pkg.shell <- llmgw.pkg <- llmgw.pkg.leaf)"]
    assert "llmgw/pkg/web.py:2 imports resource (llmgw.pkg.web)" in impurities(src, "llmgw.pkg.web")


def test_patterns_follow_a_module_into_a_subfolder() -> None:
    names = ["llmgw.router.wallet", "llmgw.router.tenants.wallet", "llmgw.router.walletx",
             "llmgw.model", "llmgw.model.node", "llmgw.model.sub.deep"]
    assert matching(["llmgw.router.**.wallet", "llmgw.model.*"], names) == {
        "llmgw.router.**.wallet": ["llmgw.router.tenants.wallet", "llmgw.router.wallet"],
        "llmgw.model.*": ["llmgw.model.node"],
    }


# ---------------------------------------------------------------------------------------------
# HTTP/1.1 below the router


def _router_modules(loaded: Iterable[str]) -> list[str]:
    return sorted(m for m in loaded if m.startswith("llmgw.router."))


@pytest.mark.parametrize("module", NO_ROUTER)
def test_no_router_module_is_loaded(module: str) -> None:
    src = source()
    came = reach(src, module)
    assert [_chain(came, m) for m in _router_modules(came)] == []


def test_the_router_check_would_see_the_router() -> None:
    # dev runs the router: it must reach it, so the check can see it.
    assert "llmgw.router.service" in _router_modules(reach(source(), "llmgw.dev"))


# ---------------------------------------------------------------------------------------------
# No circle


def test_no_import_circle_in_llmgw() -> None:
    found = cycle(graph(source(), runtime_only=True))
    assert not found, " -> ".join(found)


def test_no_import_circle_even_in_type_hints() -> None:
    # ops, status and gpu_clear once named, under TYPE_CHECKING, the Orchestrator that built
    # them: a circle in all but name. They read the cluster's state through
    # server/cluster.py now, and no module names one that imports it back.
    src = source()
    assert "llmgw.server.ops" in src.modules
    found = cycle(graph(src, runtime_only=False))
    assert not found, " -> ".join(found)


def test_the_check_finds_a_circle() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) == []


def test_a_type_checking_import_ties_nothing_at_run_time(tmp_path: Path) -> None:
    _tree(tmp_path, {"llmgw/__init__.py": "",
                     "llmgw/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from llmgw.b import B\n",
                     "llmgw/b.py": "import llmgw.a\n"})
    src = scan(tmp_path)
    assert cycle(graph(src, runtime_only=True)) == []
    assert cycle(graph(src, runtime_only=False)) == ["llmgw.a", "llmgw.b", "llmgw.a"]


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

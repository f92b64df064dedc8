"""bench/draw_lifecycles.py, run as the docs say: every row of the three lifecycle tables
(births included) is on an arrow of its diagram, no arrow is anything else, and
docs/lifecycles.md is what it draws."""

from __future__ import annotations

import enum
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "draw_lifecycles.py"
ARROW = re.compile(r"^    (\S+) --> (\S+): (.+)$")
DECLARED = re.compile(r'^    state "([^"]+)" as (\S+)$')


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stdout


def _tables() -> dict[str, dict[tuple[enum.Enum | None, enum.Enum], enum.Enum]]:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        names = importlib.import_module("draw_lifecycles").TABLES
    finally:
        sys.path.remove(str(SCRIPT.parent))
    out = {}
    for name, module in names.items():
        mod = importlib.import_module(module)
        births = {(None, b): st for b, st in getattr(mod, "BIRTHS", {}).items()}
        out[name] = {**mod.TRANSITIONS, **births}
    return out


def _rows(diagram: str) -> set[tuple[str | None, str, str]]:
    """(from, event, to) as state values, read back from a diagram's text."""
    lines = diagram.splitlines()
    assert lines[0] == "stateDiagram-v2"
    label = {"[*]": None} | {m[2]: m[1] for line in lines if (m := DECLARED.match(line))}
    rows = set()
    for line in lines[1:]:
        if DECLARED.match(line):
            continue
        m = ARROW.match(line)
        assert m, line  # nothing but declarations and arrows
        rows.update((label[m[1]], event, label[m[2]]) for event in m[3].split(", "))
    return rows


def _values(table: dict[tuple[enum.Enum | None, enum.Enum], enum.Enum]) -> set[tuple[str | None, str, str]]:
    return {(None if s is None else s.value, e.value, d.value) for (s, e), d in table.items()}


def test_three_tables_are_drawn_each_with_its_births() -> None:
    tables = _tables()
    assert sorted(tables) == ["engine", "node", "replica"]
    # The node table keeps its births apart (BIRTHS); they are drawn all the same.
    assert all(any(src is None for src, _ in t) for t in tables.values())


@pytest.mark.parametrize("name", ["engine", "node", "replica"])
def test_every_row_of_the_table_is_an_arrow(name: str) -> None:
    table = _tables()[name]
    rows = _rows(_run("--table", name))
    assert len(rows) == len(table)
    assert rows == _values(table)


def test_the_markdown_holds_each_diagram_under_its_heading() -> None:
    out = _run()
    for name in ("engine", "node", "replica"):
        block = re.search(rf"## The {name} lifecycle\n.*?```mermaid\n(.*?)```", out, re.S)
        assert block is not None, name
        assert block[1] == _run("--table", name)


def test_births_start_at_the_start_and_arrows_are_shared() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        draw = importlib.import_module("draw_lifecycles")
    finally:
        sys.path.remove(str(SCRIPT.parent))

    class S(enum.Enum):
        B = "b-state"
        A = "a"

    class E(enum.Enum):
        GO = "go"
        AGAIN = "again"
        BORN = "born"

    text = draw.mermaid({(None, E.BORN): S.A, (S.A, E.GO): S.B, (S.A, E.AGAIN): S.B})
    assert text == ('stateDiagram-v2\n    state "b-state" as B\n    state "a" as A\n'
                    "    [*] --> A: born\n    A --> B: go, again\n")


def test_the_docs_hold_what_the_script_draws() -> None:
    # docs/lifecycles.md is the script's output: a table that changes is drawn again.
    docs = ROOT / "docs" / "lifecycles.md"
    assert docs.read_text() == _run(), (
        "docs/lifecycles.md is out of step with the tables: "
        ".venv/bin/python bench/draw_lifecycles.py > docs/lifecycles.md")

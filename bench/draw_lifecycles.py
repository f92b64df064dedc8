"""Print the engine, node and replica lifecycles as Mermaid state diagrams, drawn from the
tables themselves (each module's TRANSITIONS), so the pictures in the docs cannot drift
from the code: regenerate them instead of editing them.

    .venv/bin/python bench/draw_lifecycles.py                 # all three, as Markdown
    .venv/bin/python bench/draw_lifecycles.py --table engine  # one bare diagram

Every row of a table is an arrow's label: rows with the same from and to states share one
arrow, their events joined by commas, in the table's order; a row from None (a birth) starts
at [*]. States are Mermaid ids by their enum names, labelled with their values.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import sys
from collections.abc import Mapping
from types import ModuleType

# name -> the module holding the table (TRANSITIONS: (state | None, event) -> state).
TABLES = {
    "engine": "llmgw.agent.lifecycle.states",
    "node": "llmgw.server.peers.node_states",
    "replica": "llmgw.server.reconcile.replica_states",
}
START = "[*]"

Table = Mapping[tuple[enum.Enum | None, enum.Enum], enum.Enum]


def table_of(name: str) -> tuple[ModuleType, Table]:
    module = importlib.import_module(TABLES[name])
    return module, module.TRANSITIONS


def mermaid(table: Table) -> str:
    """One stateDiagram-v2 of `table`."""
    states: dict[str, enum.Enum] = {}
    arrows: dict[tuple[str, str], list[str]] = {}
    for (src, event), dst in table.items():
        for s in (src, dst):
            if s is not None:
                states.setdefault(s.name, s)
        key = (START if src is None else src.name, dst.name)
        arrows.setdefault(key, []).append(str(event.value))
    lines = ["stateDiagram-v2"]
    # Declared in the enum's order, so the picture reads as the states are defined.
    ordered = sorted(states.values(), key=lambda s: list(type(s).__members__.values()).index(s))
    lines += [f'    state "{s.value}" as {s.name}' for s in ordered]
    lines += [f"    {src} --> {dst}: {', '.join(events)}" for (src, dst), events in arrows.items()]
    return "\n".join(lines) + "\n"


def markdown() -> str:
    out = ["<!-- Drawn by bench/draw_lifecycles.py from the tables; do not edit by hand. -->\n"]
    for name in TABLES:
        module, table = table_of(name)
        where = "src/" + module.__name__.replace(".", "/") + ".py"
        out.append(f"\n## The {name} lifecycle\n\nFrom `TRANSITIONS` in `{where}` "
                   f"({len(table)} rows).\n\n```mermaid\n{mermaid(table)}```\n")
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--table", choices=sorted(TABLES),
                        help="print this table's diagram alone, without Markdown around it")
    args = parser.parse_args(argv)
    sys.stdout.write(mermaid(table_of(args.table)[1]) if args.table else markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Print the engine, node and replica lifecycles as Mermaid state diagrams, drawn from the
tables themselves (each module's TRANSITIONS, and BIRTHS where it has them), so the pictures in the docs cannot drift
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

# name -> the module holding the table: TRANSITIONS, (state | None, event) -> state, and
# where births are apart, BIRTHS, birth -> state.
TABLES = {
    "engine": "llmgw.agent.lifecycle.states",
    "node": "llmgw.server.peers.node_states",
    "replica": "llmgw.server.reconcile.replica_states",
}
START = "[*]"

Table = Mapping[tuple[enum.Enum | None, enum.Enum], enum.Enum]


def table_of(name: str) -> tuple[ModuleType, Table]:
    """The module's TRANSITIONS, after its BIRTHS where it keeps them apart (birth -> the
    state born in, drawn as rows from None like the other tables' births)."""
    module = importlib.import_module(TABLES[name])
    births = {(None, birth): state for birth, state in getattr(module, "BIRTHS", {}).items()}
    return module, {**births, **module.TRANSITIONS}


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
    out = ["# Lifecycles\n\n"
           "<!-- Drawn by bench/draw_lifecycles.py from the tables; do not edit by hand:\n"
           "     .venv/bin/python bench/draw_lifecycles.py > docs/lifecycles.md -->\n\n"
           "The engine, node and replica lifecycles, each drawn from its table. An arrow carries\n"
           "every event of the table that leads from its state to the next; an arrow back to the\n"
           "same state is an event that leaves the state as it is (a late or repeated one, or\n"
           "news that changes nothing). An arrow from [*] is a birth: the state that one not\n"
           "yet known enters.\n"]
    for name in TABLES:
        module, table = table_of(name)
        where = "src/" + module.__name__.replace(".", "/") + ".py"
        names = "`BIRTHS` and `TRANSITIONS`" if hasattr(module, "BIRTHS") else "`TRANSITIONS`"
        out.append(f"\n## The {name} lifecycle\n\nFrom {names} in `{where}` "
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

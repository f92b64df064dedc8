"""What each fabric can serve, from the latest inventory of every node. Pure.

Fabrics are not connected to one another: weights in one are not weights in another. A
model counts for a fabric when a node in it, with the fabric not down, sees a complete
copy. One shared filer counts once however many nodes mount it, the same as any number
of local copies: the question is "can this fabric serve it".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from attrs import evolve

from llmgw.model.affinity import for_member
from llmgw.model.deployment import Member
from llmgw.model.inventory import FabricReport, FabricState, Inventory


def usable_fabrics(inv: Inventory) -> dict[str, FabricReport]:
    """The fabrics a node counts in, each with only the HCAs traffic may ride: fabric name
    -> its report, `hcas` narrowed to the healthy ones (no problems from the agent's HCA
    watch, an active port). A fabric that is down, or whose every HCA here is unhealthy,
    is left out: the node stops counting in it until an HCA is ACTIVE and quiet again."""
    sick = {h.name for h in inv.hcas if not h.healthy}
    out = {}
    for f in inv.fabrics:
        if f.state is FabricState.DOWN:
            continue
        hcas = tuple(h for h in f.hcas if h not in sick)
        if hcas:
            out[f.name] = f if len(hcas) == len(f.hcas) else evolve(f, hcas=hcas)
    return out


def sick_hcas(inv: Inventory, names: Sequence[str]) -> list[str]:
    """Of `names` (a member's HCAs), those unhealthy now, as "mlx5_0 (port 1 DOWN)"."""
    by_name = {h.name: h for h in inv.hcas}
    out = []
    for n in names:
        h = by_name.get(n)
        if h is not None and not h.healthy:
            why = "; ".join(p[:80] for p in h.problems[:2]) or "no active port"
            out.append(f"{n} ({''.join(c if c.isprintable() else '?' for c in why)})")
    return out


def islands(nodes: Mapping[str, Inventory]) -> list[str]:
    """Nodes with no fabric: each its own island, single-node replicas only."""
    return sorted(node for node, inv in nodes.items() if not inv.fabrics)


def fabric_view(nodes: Mapping[str, Inventory]) -> list[dict[str, Any]]:
    """Per fabric, sorted by name: `{"name", "nodes", "down_nodes", "gpus", "models"}`.

    `models` entries are `{"name", "shared_stores", "local_nodes"}`, sorted by name:
    the distinct shared stores holding a complete copy, and the nodes holding one locally.
    Nodes where the fabric is down are listed in `down_nodes` and count for nothing.
    """
    members: dict[str, list[str]] = {}
    down: dict[str, list[str]] = {}
    for node in sorted(nodes):
        for fab in nodes[node].fabrics:
            members.setdefault(fab.name, [])
            down.setdefault(fab.name, [])
            (down if fab.state is FabricState.DOWN else members)[fab.name].append(node)
    view = []
    for name in sorted(members):
        stores: dict[str, set[str]] = {}
        local: dict[str, set[str]] = {}
        gpus = 0
        for node in members[name]:
            inv = nodes[node]
            gpus += len(inv.gpus)
            for copy in inv.storage.models:
                if not copy.complete:
                    continue
                if copy.shared and copy.store:
                    stores.setdefault(copy.name, set()).add(copy.store)
                    local.setdefault(copy.name, set())
                else:
                    local.setdefault(copy.name, set()).add(node)
                    stores.setdefault(copy.name, set())
        view.append(
            {
                "name": name,
                "nodes": list(members[name]),
                "down_nodes": list(down[name]),
                "gpus": gpus,
                "models": [
                    {
                        "name": model,
                        "shared_stores": sorted(stores[model]),
                        "local_nodes": sorted(local[model]),
                    }
                    for model in sorted(stores)
                ],
            }
        )
    return view


def member_nics(members: Sequence[Member], nodes: Mapping[str, Inventory]) -> dict[str, list[str]]:
    """Which HCA each placed GPU of a gang rides, per node: `{"gpu-1": ["GPU 0 -> mlx5_0
    (PIX)", ...]}`, as the agent computes it for the engine's environment (the same
    function over the same inventory). Members without HCAs (single-node replicas) or
    on nodes not known here are left out."""
    out: dict[str, list[str]] = {}
    for m in members:
        inv = nodes.get(m.node_id)
        if inv is None or not m.hcas:
            continue
        nics = for_member(inv.gpus, inv.hcas, m.gpus, m.hcas)
        if nics:
            out[m.node_id] = [n.line() for n in nics]
    return out

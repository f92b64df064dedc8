"""What each fabric can serve, from the latest inventory of every node. Pure.

Fabrics are not connected to one another: weights in one are not weights in another. A
model counts for a fabric when a node in it, with the fabric not down, sees a complete
copy. One shared filer counts once however many nodes mount it, the same as any number
of local copies: the question is "can this fabric serve it".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llmgw.model.affinity import for_member
from llmgw.model.deployment import Member
from llmgw.model.inventory import FabricState, Inventory


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

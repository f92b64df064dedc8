"""What `ctl status` shows, as plain data (the same object `-o json` prints)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmgw.model.inventory import Inventory, StorageReport
from llmgw.model.node import NodeState
from llmgw.server.fabrics import fabric_view, islands

if TYPE_CHECKING:
    from llmgw.server.control import ControlPlane, Node


def _storage(s: StorageReport) -> dict[str, Any]:
    if not s.asked:
        return {"asked": False}
    return {
        "asked": True,
        "models": [
            {"name": m.name, "path": m.path, "complete": m.complete, "shared": m.shared,
             "store": m.store, "size": m.size, "reason": m.reason}
            for m in s.models
        ],
    }


def _gpus(inv: Inventory) -> list[dict[str, Any]]:
    return [
        {"uuid": g.uuid, "index": g.index, "name": g.name, "memory_total": g.memory_total,
         "memory_free": g.memory_free, "pci_bus_id": g.pci_bus_id, "numa_node": g.numa_node,
         "nvlink_peers": dict(g.nvlink_peers)}
        for g in inv.gpus
    ]


def node_view(node: Node, now: float) -> dict[str, Any]:
    inv = node.inventory
    return {
        "id": node.node_id,
        "state": str(node.state),
        "heartbeat_age": round(max(0.0, now - node.last_seen), 1),
        "connected": node.connected,
        "mgmt_addr": node.info.mgmt_addr,
        "labels": dict(node.info.labels),
        "fabrics": [{"name": f.name, "state": str(f.state), "hcas": list(f.hcas)}
                    for f in inv.fabrics],
        "gpus": _gpus(inv),
        "gpu_source": str(inv.gpu_source),
        "storage": _storage(inv.storage),
        "warnings": list(inv.warnings),
    }


def status_view(cp: ControlPlane, now: float) -> dict[str, Any]:
    nodes = sorted(cp.nodes.values(), key=lambda n: n.node_id)
    # Lost nodes' weights cannot serve anything; suspect ones still may.
    inventories = {n.node_id: n.inventory for n in nodes if n.state != NodeState.LOST}
    return {
        "nodes": [node_view(n, now) for n in nodes],
        "fabrics": fabric_view(inventories),
        "islands": islands(inventories),
    }

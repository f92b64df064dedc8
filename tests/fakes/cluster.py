"""Fixed and synthetic clusters for placement and reconcile tests and bench/placement.py."""

from __future__ import annotations

from collections.abc import Iterable

from llmgw.model.inventory import (
    FabricReport,
    FabricState,
    Gpu,
    GpuSource,
    Inventory,
    ModelCopy,
    NodeInfo,
    StorageReport,
)
from llmgw.model.node import NodeState
from llmgw.server.placement.place import NodeView


def gpus(
    node: str,
    count: int = 8,
    *,
    name: str = "NVIDIA H100 80GB HBM3",
    memory: int = 81559,
    nvlink: bool = True,
    islands: int = 1,
) -> tuple[Gpu, ...]:
    """`count` GPUs; with nvlink, `islands` NVLink cliques of equal size (1: NVSwitch)."""
    uuids = [f"GPU-{node}-{i}" for i in range(count)]
    per = max(1, count // islands)
    out = []
    for i, u in enumerate(uuids):
        peers: dict[str, int] = {}
        if nvlink:
            group = i // per
            peers = {p: 18 for j, p in enumerate(uuids) if j != i and j // per == group}
        out.append(
            Gpu(
                index=i,
                uuid=u,
                name=name,
                memory_total=memory,
                memory_free=memory,
                pci_bus_id=f"00000000:{0x18 + i * 0x10:02x}:00.0",
                numa_node=0 if i < count // 2 else 1,
                nvlink_peers=peers,
            )
        )
    return tuple(out)


def node(
    node_id: str,
    count: int = 8,
    *,
    fabrics: Iterable[str | tuple[str, FabricState]] = (),
    holds: Iterable[str] = (),
    partial: Iterable[str] = (),
    asked: bool | None = None,
    labels: dict[str, str] | None = None,
    state: NodeState = NodeState.READY,
    cordoned: bool = False,
    draining: bool = False,
    name: str = "NVIDIA H100 80GB HBM3",
    memory: int = 81559,
    nvlink: bool = True,
    islands: int = 1,
    port_range: tuple[int, int] = (20000, 29999),
    addr: str = "",
    silent_since: float | None = None,
) -> NodeView:
    reports = []
    for f in fabrics:
        fname, fstate = (f, FabricState.UP) if isinstance(f, str) else f
        reports.append(FabricReport(name=fname, hcas=("mlx5_0", "mlx5_1"), state=fstate))
    models = [ModelCopy(name=m, path=f"/models/{m}", size=1 << 30, complete=True) for m in holds]
    models += [
        ModelCopy(name=m, path=f"/models/{m}", size=1, complete=False, reason="half-written")
        for m in partial
    ]
    storage = StorageReport(asked=bool(models) if asked is None else asked, models=tuple(models))
    inv = Inventory(
        gpus=gpus(node_id, count, name=name, memory=memory, nvlink=nvlink, islands=islands),
        gpu_source=GpuSource.SIMULATED,
        fabrics=tuple(reports),
        storage=storage,
    )
    info = NodeInfo(
        node_id=node_id,
        mgmt_addr=addr or f"10.0.{hash(node_id) % 250}.{len(node_id)}",
        labels=dict(labels or {}),
        port_range=port_range,
    )
    return NodeView(
        info=info,
        inventory=inv,
        state=state,
        cordoned=cordoned,
        draining=draining,
        silent_since=silent_since,
    )


def cluster(*views: NodeView) -> dict[str, NodeView]:
    return {v.info.node_id: v for v in views}


def synthetic(
    n_nodes: int, *, fabrics: int = 8, islands_share: float = 0.05, holders: int = 20,
    model: str = "org/model",
) -> dict[str, NodeView]:
    """n_nodes of 8 NVSwitch GPUs spread over `fabrics` fabrics, some islands, a few holders."""
    out: dict[str, NodeView] = {}
    n_islands = int(n_nodes * islands_share)
    for i in range(n_nodes):
        nid = f"n{i:05d}"
        fab: tuple[str, ...] = () if i < n_islands else (f"ib-{i % fabrics}",)
        hold = (model,) if i % max(1, n_nodes // holders) == 7 else ()
        out[nid] = node(nid, 8, fabrics=fab, holds=hold, addr=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
    return out

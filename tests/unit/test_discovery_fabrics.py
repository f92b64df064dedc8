"""fabric_view: what each fabric can serve; islands."""

from __future__ import annotations

from llmgw.model.inventory import (
    FabricReport,
    FabricState,
    Gpu,
    Inventory,
    ModelCopy,
    StorageReport,
)
from llmgw.server.placement.fabrics import fabric_view, islands

LLAMA = "meta-llama/Llama-3.1-70B"
NFS = "10.0.0.5:/export/models"


def gpus(n: int) -> tuple[Gpu, ...]:
    return tuple(Gpu(i, f"GPU-{i}", "H100", 81559, 81000, f"00000000:{i:02X}:00.0") for i in range(n))


def node(
    *fabrics: tuple[str, FabricState],
    models: tuple[ModelCopy, ...] = (),
    asked: bool = True,
    n_gpus: int = 8,
) -> Inventory:
    return Inventory(
        gpus=gpus(n_gpus),
        fabrics=tuple(FabricReport(name, ("mlx5_0",), state) for name, state in fabrics),
        storage=StorageReport(asked=asked, models=models),
    )


def shared(name: str, store: str = NFS) -> ModelCopy:
    return ModelCopy(name, f"/mnt/models/{name}", 10, True, shared=True, store=store)


def local(name: str, complete: bool = True) -> ModelCopy:
    return ModelCopy(name, f"/data/{name}", 10, complete, reason="" if complete else "x")


UP = FabricState.UP


def test_shared_store_seen_by_two_nodes_counts_once_and_local_copies_by_node() -> None:
    nodes = {
        "a1": node(("ib-a", UP), models=(shared(LLAMA), local("qwen"))),
        "a2": node(("ib-a", FabricState.DEGRADED), models=(shared(LLAMA),)),
        "a3": node(("ib-a", UP), models=(local("qwen"),)),
    }
    (fab,) = fabric_view(nodes)
    assert fab["name"] == "ib-a"
    assert fab["nodes"] == ["a1", "a2", "a3"]
    assert fab["gpus"] == 24
    assert fab["models"] == [
        {"name": LLAMA, "shared_stores": [NFS], "local_nodes": []},
        {"name": "qwen", "shared_stores": [], "local_nodes": ["a1", "a3"]},
    ]


def test_weights_in_one_fabric_are_not_weights_in_another() -> None:
    nodes = {
        "a1": node(("ib-a", UP), models=(local(LLAMA),)),
        "b1": node(("ib-b", UP)),
    }
    view = {f["name"]: f for f in fabric_view(nodes)}
    assert [m["name"] for m in view["ib-a"]["models"]] == [LLAMA]
    assert view["ib-b"]["models"] == []


def test_down_fabric_and_incomplete_copies_count_for_nothing() -> None:
    nodes = {
        "a1": node(("ib-a", FabricState.DOWN), models=(shared(LLAMA),)),
        "a2": node(("ib-a", UP), models=(local("qwen", complete=False),)),
    }
    (fab,) = fabric_view(nodes)
    assert fab["nodes"] == ["a2"]
    assert fab["down_nodes"] == ["a1"]
    assert fab["gpus"] == 8
    assert fab["models"] == []


def test_not_asked_ranks_with_asked_and_found_nothing() -> None:
    holder = node(("ib-a", UP), models=(local(LLAMA),))
    never_asked = {"h": holder, "x": node(("ib-a", UP), asked=False)}
    found_nothing = {"h": holder, "x": node(("ib-a", UP), asked=True)}
    assert fabric_view(never_asked) == fabric_view(found_nothing)
    assert StorageReport(asked=False).holds(LLAMA) == StorageReport(asked=True).holds(LLAMA)
    assert StorageReport(asked=False) != StorageReport(asked=True)  # still reported apart


def test_local_copy_is_not_a_shared_store() -> None:
    nodes = {"a1": node(("ib-a", UP), models=(local(LLAMA),))}
    (fab,) = fabric_view(nodes)
    assert fab["models"] == [{"name": LLAMA, "shared_stores": [], "local_nodes": ["a1"]}]


def test_nodes_without_fabrics_are_islands() -> None:
    nodes = {
        "solo2": node(models=(local(LLAMA),)),
        "a1": node(("ib-a", UP)),
        "solo1": node(n_gpus=0),
    }
    assert islands(nodes) == ["solo1", "solo2"]
    assert [f["name"] for f in fabric_view(nodes)] == ["ib-a"]
    assert islands({}) == [] and fabric_view({}) == []

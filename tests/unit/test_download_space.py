"""A node short of space for a download is not chosen (issue 23): the agent reports
download_dir's free bytes in its StorageReport; placement refuses a node that would
download the model (no complete copy) into less space than another node's copy takes,
and explain says so; unknown size or free space is never a reason."""

from __future__ import annotations

from pathlib import Path

from attrs import evolve

from fakes.cluster import cluster, node
from llmgw.agent.discovery.discover import FREE_SPACE_SLACK, inventory_changed
from llmgw.agent.discovery.storage import free_space, scan_storage
from llmgw.config.agent import ModelDirConfig
from llmgw.model.deployment import Deployment
from llmgw.model.engine import EngineKind
from llmgw.model.inventory import Inventory, StorageReport
from llmgw.server.placement.cluster_view import NodeView
from llmgw.server.placement.place import ClusterView, Placement, Unschedulable, place

GIB = 2**30


def dep(model: str = "org/m") -> Deployment:
    return Deployment(name="d", model=model, engine=EngineKind.VLLM, gpus_per_node=1, replicas=1)


def spaced(v: NodeView, free: int, where: str = "/data") -> NodeView:
    storage = evolve(v.inventory.storage, download_dir=where, download_free=free)
    return evolve(v, inventory=evolve(v.inventory, storage=storage))


def test_a_node_short_of_space_is_not_chosen() -> None:
    def second(b_free: int) -> str:
        # The holder's one GPU is taken by the first replica; spread (the default)
        # would take b, with the most GPUs free; c has room.
        c = cluster(node("a", 1, holds=["org/m"]), spaced(node("b", 8), b_free),
                    spaced(node("c", 2), 2 * GIB))
        view = ClusterView(c)
        first = place(dep(), view)
        assert isinstance(first, Placement) and first.members[0].node_id == "a"
        view.reserve(first.members)
        p = place(dep(), view)
        assert isinstance(p, Placement)
        return p.members[0].node_id

    assert second(2 * GIB) == "b"
    assert second(GIB // 2) == "c"


def test_explain_names_the_space_and_the_need() -> None:
    c = cluster(node("a", 1, holds=["org/m"]), spaced(node("b", 8), GIB // 4, "/data"))
    view = ClusterView(c)
    p = place(dep(), view)
    assert isinstance(p, Placement) and p.members[0].node_id == "a"
    view.reserve(p.members)
    r = place(dep(), view)
    assert isinstance(r, Unschedulable), r
    assert r.reason.startswith("0/2 nodes fit: ")
    assert "1 lacked 1.0 GiB free in download_dir for the model" in r.reason
    assert r.reason.endswith(". b: download_dir /data has 0.2 GiB free, the model needs 1.0 GiB")


def test_unknown_size_or_free_space_or_a_holder_is_never_refused() -> None:
    # Nobody holds it: size unknown, the download may go anywhere.
    assert isinstance(place(dep(), cluster(spaced(node("b", 8), 0))), Placement)
    # Free space not reported (-1): room enough.
    c = cluster(node("a", 1, holds=["org/m"]), spaced(node("b", 8), -1))
    view = ClusterView(c)
    view.reserve(place(dep(), view).members)  # type: ignore[union-attr]
    assert isinstance(place(dep(), view), Placement)
    # A holder downloads nothing, whatever its download_dir has.
    assert isinstance(place(dep(), cluster(spaced(node("a", 1, holds=["org/m"]), 0))), Placement)
    # A path is opened, not downloaded.
    c = cluster(node("a", 1, holds=["/models/x"]), spaced(node("b", 8), 0))
    view = ClusterView(c)
    view.reserve(place(dep("/models/x"), view).members)  # type: ignore[union-attr]
    assert isinstance(place(dep("/models/x"), view), Placement)


def test_model_size_comes_from_a_complete_copy() -> None:
    view = ClusterView(cluster(node("a", holds=["org/m"]), node("b", partial=["org/m"])))
    assert view.model_size("org/m") == GIB
    assert view.model_size("org/other") == 0


def test_agent_reports_free_space_under_the_nearest_existing_parent(tmp_path: Path) -> None:
    free = free_space(str(tmp_path / "not" / "yet"))
    assert free > 0
    assert free_space(str(tmp_path)) > 0
    (tmp_path / "models").mkdir()
    scan = scan_storage((ModelDirConfig(str(tmp_path / "models")),), [],
                        download_dir=str(tmp_path / "dl"))
    assert scan.report.download_dir == str(tmp_path / "dl")
    assert scan.report.download_free > 0
    none = scan_storage(None, [], download_dir="")
    assert none.report.download_free == -1 and not none.report.asked


def test_small_moves_of_free_space_are_no_inventory_change() -> None:
    def inv(free: int) -> Inventory:
        return Inventory(storage=StorageReport(True, (), "/data", free))

    assert not inventory_changed(inv(100 * GIB), inv(100 * GIB + FREE_SPACE_SLACK - 1))
    assert inventory_changed(inv(100 * GIB), inv(100 * GIB - FREE_SPACE_SLACK))
    assert inventory_changed(inv(-1), inv(100 * GIB))

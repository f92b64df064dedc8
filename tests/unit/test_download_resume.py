"""A download already under way is room of its own (issue 23): the agent reports the
bytes of each unfinished download in its download_dir; placement counts them as room for
that model, so a second replica on the node (which shares the download) or a restart
mid-download (which resumes it) is not refused for the space the first download took.
Another model's partial download is used space like any other."""

from __future__ import annotations

from pathlib import Path

import msgpack
from attrs import evolve

from fakes.cluster import cluster, node
from llmgw.agent.discovery.discover import FREE_SPACE_SLACK, inventory_changed
from llmgw.agent.discovery.storage import scan_downloads, scan_storage
from llmgw.model.deployment import Deployment
from llmgw.model.engine import EngineKind
from llmgw.model.inventory import Inventory, StorageReport
from llmgw.server.placement.cluster_view import NodeView
from llmgw.server.placement.fit import download_room
from llmgw.server.placement.place import ClusterView, Placement, Unschedulable, place
from llmgw.transport.codec import converter

GIB = 2**30  # the fakes' complete copies are 1 GiB


def dep(model: str = "org/m") -> Deployment:
    return Deployment(name="d", model=model, engine=EngineKind.VLLM, gpus_per_node=1, replicas=2)


def spaced(v: NodeView, free: int, downloading: dict[str, int] | None = None) -> NodeView:
    storage = evolve(v.inventory.storage, download_dir="/data", download_free=free,
                     downloading=dict(downloading or {}))
    return evolve(v, inventory=evolve(v.inventory, storage=storage))


def test_download_room_counts_the_bytes_already_there() -> None:
    assert download_room(10, 4, 0) == 6
    assert download_room(10, 4, 6) == 0  # the rest fits exactly
    assert download_room(10, 4, 5) == 1
    assert download_room(10, 0, 10) == 0  # all there, the last file not renamed yet
    assert download_room(10, 0, 12) == 0  # more on disk than the size (a stale blob)
    assert download_room(0, 0, 0) == 0  # size unknown: never a reason
    assert download_room(10, -1, 0) == 0  # free space unknown: never a reason
    assert download_room(10, 4, -3) == 6  # nonsense from a peer counts as nothing


def _second(b: NodeView) -> Placement | Unschedulable:
    """Where the second replica goes once the holder's only GPU has the first."""
    view = ClusterView(cluster(node("a", 1, holds=["org/m"]), b))
    first = place(dep(), view)
    assert isinstance(first, Placement) and first.members[0].node_id == "a"
    view.reserve(first.members)
    return place(dep(), view)


def test_a_download_under_way_on_the_node_is_not_charged_again() -> None:
    # b had 1.5 GiB free; the first download took 0.75 of it and goes on.
    p = _second(spaced(node("b", 8), 3 * GIB // 4, {"org/m": 3 * GIB // 4}))
    assert isinstance(p, Placement) and p.members[0].node_id == "b"
    # Only part of it there: the rest must fit.
    r = _second(spaced(node("b", 8), GIB // 4, {"org/m": GIB // 2}))
    assert isinstance(r, Unschedulable), r
    assert r.reason.endswith(". b: download_dir /data has 0.2 GiB free, the model needs "
                             "1.0 GiB (0.5 GiB of it already there)")


def test_another_models_download_is_used_space() -> None:
    r = _second(spaced(node("b", 8), GIB // 2, {"org/other": 10 * GIB}))
    assert isinstance(r, Unschedulable), r
    assert r.reason.endswith(". b: download_dir /data has 0.5 GiB free, the model needs 1.0 GiB")


def test_two_replicas_on_one_node_share_one_download() -> None:
    # Exactly one copy's room: both replicas go to b in one pass, charged once.
    view = ClusterView(cluster(node("a", 0, holds=["org/m"]), spaced(node("b", 8), GIB)))
    for _ in range(2):
        p = place(dep(), view)
        assert isinstance(p, Placement) and p.members[0].node_id == "b"
        view.reserve(p.members)


def _blob(repo: Path, name: str, size: int) -> None:
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "blobs" / name).write_bytes(b"x" * size)


def test_the_agent_reports_unfinished_downloads(tmp_path: Path) -> None:
    dl = tmp_path / "dl"
    # Under way: one blob whole, one still .incomplete, no snapshot yet.
    _blob(dl / "models--org--m", "aaa", 300)
    _blob(dl / "models--org--m", "bbb.incomplete", 200)
    # Finished: a snapshot of whole files, no marker; not a download under way.
    done = dl / "models--org--done"
    _blob(done, "ccc", 100)
    snap = done / "snapshots" / "rev1"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").symlink_to(done / "blobs" / "ccc")
    # Begun, nothing written yet: nothing to count.
    (dl / "models--org--empty" / "blobs").mkdir(parents=True)
    assert scan_downloads(str(dl)) == {"org/m": 500}
    assert scan_downloads(str(tmp_path / "absent")) == {}
    report = scan_storage(None, [], download_dir=str(dl)).report
    assert report.downloading == {"org/m": 500} and report.download_free > 0
    wire = msgpack.unpackb(msgpack.packb(converter.unstructure(report)))
    assert converter.structure(wire, StorageReport) == report
    # An agent from before sends no such key: nothing under way.
    del wire["downloading"]
    assert converter.structure(wire, StorageReport).downloading == {}


def test_download_growth_within_the_slack_is_not_a_change() -> None:
    def inv(free: int, downloading: dict[str, int]) -> Inventory:
        return Inventory(storage=StorageReport(download_dir="/d", download_free=free,
                                               downloading=downloading))

    old = inv(100 * GIB, {"org/m": GIB})
    step = FREE_SPACE_SLACK // 2
    assert not inventory_changed(old, inv(100 * GIB - step, {"org/m": GIB + step}))
    assert inventory_changed(old, inv(100 * GIB, {"org/m": GIB + FREE_SPACE_SLACK}))
    assert inventory_changed(old, inv(100 * GIB, {"org/m": GIB, "org/n": 1}))  # a new one
    assert inventory_changed(old, inv(100 * GIB, {}))  # finished (or removed)

"""A download's progress shown (issue 23): the status document passes each member's
EngineReport.download on (the status page's replica rows while starting, `describe
replica` always), and `describe replica` renders it."""

from __future__ import annotations

from types import SimpleNamespace

from llmgw.ctl.render import _describe_node, _describe_replica
from llmgw.model.deployment import Deployment, Member, Replica, ReplicaState
from llmgw.model.engine import EngineKind, EngineReport, EngineState
from llmgw.model.inventory import StorageReport
from llmgw.server.status import _storage, member_downloads, replica_rows

LINE = "12.3 GB on disk, 210.0 MB/s"
DEP = Deployment(name="big", model="org/big", engine=EngineKind.SIMULATED, gpus_per_node=1,
                 replicas=1)


def _orchestrator(r: Replica, reports: dict[str, EngineReport]) -> SimpleNamespace:
    nodes = {n: SimpleNamespace(engines={r.id: rep}) for n, rep in reports.items()}
    return SimpleNamespace(cp=SimpleNamespace(nodes=nodes), replicas={r.id: r})


def _replica(state: ReplicaState) -> Replica:
    return Replica("big-0", "big", 0, DEP, generation=2, state=state,
                   members=(Member("n1", 0, ("g1",), 20000), Member("n2", 1, ("g2",), 20000)))


def test_members_downloading_this_generation_only() -> None:
    r = _replica(ReplicaState.STARTING)
    o = _orchestrator(r, {
        "n1": EngineReport("big-0", 2, EngineState.STARTING, download=LINE),
        "n2": EngineReport("big-0", 1, EngineState.STARTING, download="old generation"),
    })
    assert member_downloads(o, r) == {"n1": LINE}  # type: ignore[arg-type]


def test_status_rows_show_it_while_starting_only() -> None:
    rep = {"n1": EngineReport("big-0", 2, EngineState.STARTING, download=LINE)}
    starting = _replica(ReplicaState.STARTING)
    assert replica_rows(_orchestrator(starting, rep))[0]["download"] == {"n1": LINE}  # type: ignore[arg-type]
    ready = _replica(ReplicaState.READY)
    assert "download" not in replica_rows(_orchestrator(ready, rep))[0]  # type: ignore[arg-type]


def test_describe_renders_one_line_or_one_per_node() -> None:
    base = {"id": "big-0", "deployment": "big", "state": "starting", "generation": 2}
    one = _describe_replica({**base, "download": {"n1": LINE}}).splitlines()
    assert f"Download:   {LINE} (on n1)" in one
    two = _describe_replica({**base, "download": {"n2": "1.0 GB on disk, 0 B/s", "n1": LINE}})
    lines = two.splitlines()
    i = lines.index("Download:")
    assert lines[i + 1:i + 3] == [f"  n1: {LINE}", "  n2: 1.0 GB on disk, 0 B/s"]
    assert "Download" not in _describe_replica({**base, "download": {}})


def test_describe_node_names_download_dir_and_its_space() -> None:
    base = {"id": "n1", "state": "ready", "heartbeat_age": 0, "gpus": []}
    shown = _storage(StorageReport(True, (), "/data/dl", 40 * 2**30))
    assert shown["download_dir"] == "/data/dl" and shown["download_free"] == 40 * 2**30
    assert "Downloads: /data/dl (40.0 GiB free)" in _describe_node({**base, "storage": shown})
    unknown = _storage(StorageReport(False, (), "/data/dl", -1))
    assert "Downloads: /data/dl (free space unknown)" in _describe_node({**base, "storage": unknown})
    assert "Downloads" not in _describe_node({**base, "storage": _storage(StorageReport(True))})

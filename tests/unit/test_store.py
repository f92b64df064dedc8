"""The SQLite store: round trips, reopening, migration from nothing."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from fakes.cluster import cluster, node
from llmgw.model.deployment import Deployment, Strategy
from llmgw.model.engine import EngineKind, EngineReport, EngineState
from llmgw.model.inventory import FabricState
from llmgw.server.reconcile import reconcile
from llmgw.server.store import SCHEMA_VERSION, Store, StoredEvent, StoreError


def dep(name: str = "d", replicas: int = 2, nodes: int = 1) -> Deployment:
    return Deployment(
        name=name,
        model="org/m",
        engine=EngineKind.VLLM,
        gpus_per_node=4,
        replicas=replicas,
        nodes=nodes,
        selector={"rack": "r1"},
        args=("--max-model-len", "4096"),
        env={"A": "1"},
        startup_timeout=120.0,
        strategy=Strategy.PACK,
        gpu_memory_min=1000,
    )


def test_fresh_db_is_migrated_and_wal(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    with Store(path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        assert s.deployments() == {} and s.replicas() == {} and s.nodes() == {}
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()


def test_migration_from_an_empty_existing_db(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    sqlite3.connect(path).close()  # an empty file: version 0
    with Store(path) as s:
        assert s.schema_version() == SCHEMA_VERSION
    with Store(path) as s:  # reopening migrates nothing again
        assert s.schema_version() == SCHEMA_VERSION


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE schema_version SET version = 999")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="newer"):
        Store(path)


def test_deployments_round_trip_and_delete(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    with Store(path) as s:
        s.put_deployment(dep("a"))
        s.put_deployment(dep("b"))
        s.put_deployment(dep("a", replicas=5))
    with Store(path) as s:
        got = s.deployments()
        assert got == {"a": dep("a", replicas=5), "b": dep("b")}
        assert s.delete_deployment("b") and not s.delete_deployment("b")
        assert list(s.deployments()) == ["a"]


def test_replicas_events_and_floor_round_trip(tmp_path: Path) -> None:
    c = cluster(
        node("n1", fabrics=["ib"], labels={"rack": "r1"}),
        node("n2", fabrics=["ib"], labels={"rack": "r1"}),
    )
    d = dep(nodes=2, replicas=1)
    res = reconcile({"d": d}, {}, c, {}, 10.0)
    r = res.replicas["d-0"]
    assert r.placed
    rep = {m.node_id: [EngineReport("d-0", r.generation, EngineState.EXITED, log_tail=("x",))]
           for m in r.members}
    res2 = reconcile({"d": d}, res.replicas, c, rep, 11.0, generation_floor=res.generation_floor)
    path = str(tmp_path / "state.db")
    evs = [StoredEvent(11.0, e.deployment, e.replica, e.text) for e in res.events + res2.events]
    with Store(path) as s:
        s.save_replicas(res.replicas, generation_floor=res.generation_floor)
        s.save_replicas(res2.replicas, events=evs, generation_floor=res2.generation_floor)
    with Store(path) as s:
        assert s.replicas() == res2.replicas
        assert s.generation_floor() == res2.generation_floor
        got = s.events(deployment="d")
        assert [e.text for e in got] == [e.text for e in evs]
        assert s.events(replica="nope") == []
        assert len(s.events(limit=1)) == 1 and s.events(limit=1)[0] == evs[-1]
        s.save_replicas({})
        assert s.replicas() == {}


def test_nodes_round_trip_keeps_cordon(tmp_path: Path) -> None:
    v = node("n1", fabrics=[("ib", FabricState.DEGRADED)], holds=["org/m"], labels={"a": "b"})
    path = str(tmp_path / "state.db")
    with Store(path) as s:
        assert not s.set_cordoned("n1", True)  # unknown
        s.put_node(v.info, v.inventory, 5.0)
        assert s.set_cordoned("n1", True, draining=True)
        s.put_node(v.info, v.inventory, 6.0)  # a later hello keeps the flags
    with Store(path) as s:
        n = s.nodes()["n1"]
        assert n.info == v.info and n.inventory == v.inventory
        assert n.cordoned and n.draining and n.last_seen == 6.0
        s.set_cordoned("n1", False)
        assert not s.nodes()["n1"].cordoned
        assert s.delete_node("n1") and s.nodes() == {}


def test_trim_events(tmp_path: Path) -> None:
    with Store(str(tmp_path / "s.db")) as s:
        s.add_events(StoredEvent(float(i), "d", "d-0", f"e{i}") for i in range(10))
        s.trim_events(keep=3)
        assert [e.text for e in s.events(limit=100)] == ["e7", "e8", "e9"]


def test_unopenable_path_is_a_store_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError):
        Store(str(tmp_path / "missing" / "dir" / "state.db"))

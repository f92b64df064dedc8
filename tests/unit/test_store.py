"""The store on both engines (SQLite, and a real PostgreSQL when it is installed):
round trips, reopening, migrations; SQLite's own file behaviour."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from attrs import evolve

from fakes.cluster import cluster, node
from llmgw.model.deployment import Deployment, Strategy
from llmgw.model.engine import EngineKind, EngineReport, EngineState
from llmgw.model.inventory import FabricState
from llmgw.server.reconcile.rules import reconcile
from llmgw.server.store.sql import SCHEMA_VERSION, SqlStore, Store, StoredEvent, StoreError


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


Opener = Callable[[], SqlStore]


@pytest.fixture(params=["sqlite", "postgres"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Opener:
    """Opens the same (at first empty) database each call, on one engine."""
    if request.param == "sqlite":
        path = str(tmp_path / "state.db")
        return lambda: Store(path)
    from llmgw.server.store.postgres import PgStore

    url = request.getfixturevalue("pg_url")
    return lambda: PgStore(url)


def test_fresh_db_is_migrated(opener: Opener) -> None:
    with opener() as s:
        assert s.schema_version() == SCHEMA_VERSION
        assert s.deployments() == {} and s.replicas() == {} and s.nodes() == {}
    with opener() as s:  # reopening migrates nothing again
        assert s.schema_version() == SCHEMA_VERSION


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


def test_deployments_round_trip_and_delete(opener: Opener) -> None:
    with opener() as s:
        s.put_deployment(dep("a"))
        s.put_deployment(dep("b"))
        s.put_deployment(dep("a", replicas=5))
    with opener() as s:
        got = s.deployments()
        assert got == {"a": dep("a", replicas=5), "b": dep("b")}
        assert s.delete_deployment("b") and not s.delete_deployment("b")
        assert list(s.deployments()) == ["a"]


def test_replicas_events_and_floor_round_trip(opener: Opener) -> None:
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
    evs = [StoredEvent(11.0, e.deployment, e.replica, e.text) for e in res.events + res2.events]
    with opener() as s:
        s.save_replicas(res.replicas, generation_floor=res.generation_floor)
        s.save_replicas(res2.replicas, events=evs, generation_floor=res2.generation_floor)
    with opener() as s:
        assert s.replicas() == res2.replicas
        assert s.generation_floor() == res2.generation_floor
        got = s.events(deployment="d")
        assert [e.text for e in got] == [e.text for e in evs]
        assert s.events(replica="nope") == []
        assert len(s.events(limit=1)) == 1 and s.events(limit=1)[0] == evs[-1]
        s.save_replicas({})
        assert s.replicas() == {}


def test_nodes_round_trip_keeps_cordon(opener: Opener) -> None:
    v = node("n1", fabrics=[("ib", FabricState.DEGRADED)], holds=["org/m"], labels={"a": "b"})
    with opener() as s:
        assert not s.set_cordoned("n1", True)  # unknown
        s.put_node(v.info, v.inventory, 5.0)
        assert s.set_cordoned("n1", True, draining=True)
        s.put_node(v.info, v.inventory, 6.0)  # a later hello keeps the flags
    with opener() as s:
        n = s.nodes()["n1"]
        assert n.info == v.info and n.inventory == v.inventory
        assert n.cordoned and n.draining and n.last_seen == 6.0
        s.set_cordoned("n1", False)
        assert not s.nodes()["n1"].cordoned
        assert s.delete_node("n1") and s.nodes() == {}


def test_trim_events(opener: Opener) -> None:
    with opener() as s:
        s.add_events(StoredEvent(float(i), "d", "d-0", f"e{i}") for i in range(10))
        s.trim_events(keep=3)
        assert [e.text for e in s.events(limit=100)] == ["e7", "e8", "e9"]


def test_unopenable_path_is_a_store_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError):
        Store(str(tmp_path / "missing" / "dir" / "state.db"))


def test_state_id_is_made_once_and_kept(opener: Opener) -> None:
    with opener() as s:
        first = s.state_id()
        assert len(first) == 32 and s.state_id() == first
    with opener() as s, opener() as t:
        assert s.state_id() == t.state_id() == first


def test_replica_rows_are_replaced_not_duplicated(opener: Opener) -> None:
    c = cluster(node("n1", fabrics=["ib"], labels={"rack": "r1"}))
    res = reconcile({"d": dep(replicas=1)}, {}, c, {}, 10.0)
    moved = {rid: r for rid, r in res.replicas.items()}
    with opener() as s:
        s.save_replicas(res.replicas)
        s.save_replicas(moved)
        s.save_replicas(res.replicas)  # unchanged rows: nothing rewritten, nothing lost
        assert s.replicas() == res.replicas


def test_a_deployment_is_saved_in_its_plain_shape_and_old_rows_still_read(tmp_path: Path) -> None:
    """One saved shape (issue 21): the store keeps Deployment.plain(), alone and as a
    replica's spec, and reads it through parse_deployment. Rows written by older llmgw in
    cattrs' default shape (enums as their values, every field spelled out) read the same."""
    import json

    from cattrs.preconf.json import make_converter

    from llmgw.model.deployment import Replica

    path = str(tmp_path / "state.db")
    d = dep("a")
    r = Replica(id="a-0", deployment="a", index=0, spec=d, generation=3)
    with Store(path) as s:
        s.put_deployment(d)
        s.save_replicas({"a-0": r})
    db = sqlite3.connect(path)
    (spec,) = db.execute("SELECT spec FROM deployments WHERE name = 'a'").fetchone()
    (data,) = db.execute("SELECT data FROM replicas WHERE id = 'a-0'").fetchone()
    assert json.loads(spec) == d.plain() and json.loads(data)["spec"] == d.plain()
    # As the store wrote them before: cattrs' default shape, with the fields of that time.
    fields_then = ("name", "model", "engine", "gpus_per_node", "replicas", "nodes", "served_name",
                   "gpu_memory_min", "selector", "args", "env", "startup_timeout", "strategy")
    old = make_converter()
    old_spec = {k: v for k, v in old.unstructure(d, Deployment).items() if k in fields_then}
    old_replica = {**old.unstructure(r, Replica), "spec": old_spec}
    with db:
        db.execute("UPDATE deployments SET spec = ? WHERE name = 'a'", (json.dumps(old_spec),))
        db.execute("UPDATE replicas SET data = ? WHERE id = 'a-0'", (json.dumps(old_replica),))
    db.close()
    with Store(path) as s:
        assert s.deployments() == {"a": d} and s.replicas() == {"a-0": r}


def test_a_row_that_is_no_deployment_is_a_store_error(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    with Store(path) as s:
        s.put_deployment(dep("a"))
    db = sqlite3.connect(path)
    with db:
        db.execute("UPDATE deployments SET spec = ? WHERE name = 'a'",
                   ('{"name": "a", "model": "org/m", "engine": "trt", "gpus_per_node": 1, "replicas": 1}',))
    db.close()
    with Store(path) as s, pytest.raises(StoreError, match="cannot read: the state database: engine: "):
        s.deployments()


def test_api_keys_round_trip_and_only_the_hash_is_kept(opener: Opener) -> None:
    from llmgw.model.apikey import ApiKeyRecord, Budget, hash_secret, make_secret

    secret = make_secret(bytes(range(32)))
    k = ApiKeyRecord("team-a", hash_secret(secret), secret[:12], created=5.0, models=("m",),
                     rpm=10, tpm=1000, concurrency=4, budget=Budget(10**6, 86400.0))
    with opener() as s:
        s.put_api_key(k, now=5.0)
        s.put_api_key(ApiKeyRecord("team-b", hash_secret("x"), "x"))
    with opener() as s:
        assert s.api_keys() == {"team-a": k, "team-b": ApiKeyRecord("team-b", hash_secret("x"), "x")}
        s.put_api_key(evolve(k, revoked=9.0), now=9.0)
        assert s.api_keys()["team-a"].state(10.0) == "revoked"
    with opener() as s:
        stored = repr(s._read("SELECT name, sha256, data FROM api_keys"))
    assert secret not in stored and secret[12:] not in stored


def test_a_usage_batch_counts_once_and_adds_to_its_hour(opener: Opener) -> None:
    from llmgw.model.usage import UsageRow

    rows = [UsageRow("a", "m", 3600, 200, 2, 10, 20, 0.5), UsageRow("a", "m", 3600, 200, 1, 1, 2, 0.25),
            UsageRow("a", "m", 3600, 429, 1), UsageRow("b", "m", 7200, 200, 1, 5, 5, 0.1)]
    with opener() as s:
        assert s.add_usage("r1-1", rows, now=7300.0)
        assert not s.add_usage("r1-1", rows, now=7301.0)  # retried after a failover: once
        assert s.add_usage("r2-1", rows[:1], now=7302.0)
    with opener() as s:
        got = s.usage()
        assert got == [UsageRow("a", "m", 3600, 200, 5, 21, 42, 1.25), UsageRow("a", "m", 3600, 429, 1),
                       UsageRow("b", "m", 7200, 200, 1, 5, 5, 0.1)]
        assert s.usage(api_key="b") == got[2:] and s.usage(since=7200.5) == got[2:]
        assert s.usage(model="other") == []
        s.trim_usage_batches(before=7302.0)
        assert s.add_usage("r1-1", [], now=7400.0)  # forgotten ids may come again

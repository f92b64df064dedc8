"""The server's durable state, behind one interface with two engines.

Deployments, replicas (assignments with generations), nodes (info, last inventory,
cordon/drain flags), an event log, and a small meta table (the generation floor).
A method that returns has committed: what ctl was told succeeded survives a SIGKILL.

`SqlStore` holds every query, written once in the SQL both engines speak (`?`
placeholders, `ON CONFLICT ... DO UPDATE`); an engine supplies transactions and reads:
`Store` here is SQLite in WAL mode with synchronous=FULL (the embedded default, one
server), store_pg.PgStore is PostgreSQL (several servers, one leader, every write fenced
by the leader's epoch). `stores.open_store` picks one from the server's configuration.

The API is synchronous; the trio service calls it through `trio.to_thread.run_sync`,
one call at a time (a lock guards the connection all the same). A PostgreSQL round trip
on a local network costs well under a millisecond, so this is no worse than SQLite's fsync.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from attrs import frozen
from cattrs.preconf.json import make_converter

from llmgw.config.deployment import parse_deployment
from llmgw.errors import DeploymentError, LlmgwError
from llmgw.model.apikey import ApiKeyRecord
from llmgw.model.deployment import Deployment, Replica
from llmgw.model.inventory import Inventory, NodeInfo
from llmgw.model.usage import UsageRow, hour_of, merge
from llmgw.server.store import migrations
from llmgw.server.store.migrations import SCHEMA_VERSION as SCHEMA_VERSION

T = TypeVar("T")

class StoreError(LlmgwError):
    """The state database cannot be opened, read or migrated."""

    exit_code = 2


class FencedError(StoreError):
    """A write was refused because this server's leader epoch is no longer current: another
    server leads now (or the lease ran out). The writer must step down."""


@frozen
class StoredNode:
    info: NodeInfo
    inventory: Inventory
    cordoned: bool = False
    draining: bool = False
    last_seen: float = 0.0


@frozen
class StoredEvent:
    ts: float
    deployment: str
    replica: str
    text: str


_conv = make_converter()
# A Deployment (alone, or as a replica's spec) is saved in its one plain shape, what a
# deployment file holds (Deployment.plain()), and read back through the deployment files'
# own validator: the store holds no shape the rest of llmgw does not. Rows saved by older
# llmgw in cattrs' default shape hold the same keys and values and read the same way, so
# they need no migration (tests/unit/test_store.py reads such rows).
_conv.register_unstructure_hook(Deployment, lambda d: d.plain())
_conv.register_structure_hook(Deployment, lambda data, _: parse_deployment(data, "the state database"))


def _dump(obj: Any, cls: type) -> str:
    return json.dumps(_conv.unstructure(obj, cls), separators=(",", ":"), sort_keys=True)


def _load(text: str, cls: type[T]) -> T:
    try:
        return _conv.structure(json.loads(text), cls)
    except DeploymentError as exc:
        raise StoreError(f"the state database holds a deployment llmgw cannot read: {exc}") from None


class Tx(Protocol):
    """One open transaction, in the SQL both engines speak (`?` placeholders)."""

    def run(self, sql: str, args: Sequence[Any] = ()) -> int: ...  # rows affected
    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...
    def many(self, sql: str, seq: Sequence[Sequence[Any]]) -> None: ...


class StateStore(Protocol):
    """What the orchestrator needs of durable state; both engines provide it."""

    def close(self) -> None: ...
    def schema_version(self) -> int: ...
    def put_deployment(self, d: Deployment, now: float = 0.0) -> None: ...
    def delete_deployment(self, name: str) -> bool: ...
    def deployments(self) -> dict[str, Deployment]: ...
    def replicas(self) -> dict[str, Replica]: ...
    def save_replicas(self, replicas: Mapping[str, Replica], *, events: Iterable[StoredEvent] = (),
                      generation_floor: int | None = None) -> None: ...
    def state_id(self) -> str: ...
    def generation_floor(self) -> int: ...
    def put_node(self, info: NodeInfo, inventory: Inventory, last_seen: float) -> None: ...
    def put_nodes(self, nodes: Iterable[tuple[NodeInfo, Inventory, float]]) -> None: ...
    def set_cordoned(self, node_id: str, cordoned: bool, *, draining: bool = False) -> bool: ...
    def delete_node(self, node_id: str) -> bool: ...
    def nodes(self) -> dict[str, StoredNode]: ...
    def add_events(self, events: Iterable[StoredEvent]) -> None: ...
    def events(self, *, deployment: str | None = None, replica: str | None = None,
               limit: int = 100) -> list[StoredEvent]: ...
    def trim_events(self, keep: int = 100_000) -> None: ...
    def put_api_key(self, key: ApiKeyRecord, now: float = 0.0) -> None: ...
    def api_keys(self) -> dict[str, ApiKeyRecord]: ...
    def add_usage(self, batch_id: str, rows: Iterable[UsageRow], now: float) -> bool: ...
    def usage(self, *, api_key: str | None = None, model: str | None = None,
              since: float = 0.0) -> list[UsageRow]: ...
    def trim_usage_batches(self, before: float) -> None: ...


class SqlStore:
    """Every query of the state, once; an engine subclass supplies `_tx` and `_read`."""

    where = ""  # names the database in errors

    def _tx(self, fn: Callable[[Tx], T]) -> T:
        raise NotImplementedError

    def _read(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> SqlStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def schema_version(self) -> int:
        rows = self._read("SELECT version FROM schema_version")
        return int(rows[0][0]) if rows else 0

    # ------------------------------------------------------------ deployments

    def put_deployment(self, d: Deployment, now: float = 0.0) -> None:
        spec = _dump(d, Deployment)
        self._tx(lambda tx: tx.run(
            "INSERT INTO deployments (name, spec, updated) VALUES (?, ?, ?) "
            "ON CONFLICT(name) DO UPDATE SET spec = excluded.spec, updated = excluded.updated",
            (d.name, spec, now)))

    def delete_deployment(self, name: str) -> bool:
        """Forget a deployment (its replicas go when reconcile says so). True if it existed."""
        return self._tx(lambda tx: tx.run("DELETE FROM deployments WHERE name = ?", (name,))) > 0

    def deployments(self) -> dict[str, Deployment]:
        rows = self._read("SELECT name, spec FROM deployments ORDER BY name")
        return {name: _load(spec, Deployment) for name, spec in rows}

    # ------------------------------------------------------------ replicas

    def replicas(self) -> dict[str, Replica]:
        rows = self._read("SELECT id, data FROM replicas ORDER BY id")
        return {rid: _load(data, Replica) for rid, data in rows}

    def save_replicas(
        self,
        replicas: Mapping[str, Replica],
        *,
        events: Iterable[StoredEvent] = (),
        generation_floor: int | None = None,
    ) -> None:
        """Make the stored replicas exactly `replicas`, with events and floor, atomically."""
        evs = list(events)
        dumped = {rid: _dump(r, Replica) for rid, r in replicas.items()}

        def run(tx: Tx) -> None:
            have = dict(tx.rows("SELECT id, data FROM replicas"))
            gone = [(rid,) for rid in have.keys() - replicas.keys()]
            if gone:
                tx.many("DELETE FROM replicas WHERE id = ?", gone)
            changed = [(rid, r.deployment, r.generation, dumped[rid])
                       for rid, r in replicas.items() if have.get(rid) != dumped[rid]]
            if changed:
                tx.many(
                    "INSERT INTO replicas (id, deployment, generation, data) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT(id) DO UPDATE SET deployment = excluded.deployment, "
                    "generation = excluded.generation, data = excluded.data",
                    changed)
            _insert_events(tx, evs)
            if generation_floor is not None:
                _set_meta(tx, "generation_floor", str(generation_floor))

        self._tx(run)

    def state_id(self) -> str:
        """A random id made with this state (once, kept in meta): engines carry the id of
        the state that issued them, so a server can tell its own from a lost state's."""
        rows = self._read("SELECT value FROM meta WHERE key = 'state_id'")
        if rows:
            return str(rows[0][0])
        new = uuid.uuid4().hex

        def run(tx: Tx) -> str:
            # Two servers meeting a fresh database: the first id written is the one.
            tx.run("INSERT INTO meta (key, value) VALUES ('state_id', ?) ON CONFLICT(key) DO NOTHING",
                   (new,))
            return str(tx.rows("SELECT value FROM meta WHERE key = 'state_id'")[0][0])

        return self._tx(run)

    def generation_floor(self) -> int:
        rows = self._read("SELECT value FROM meta WHERE key = 'generation_floor'")
        return int(rows[0][0]) if rows else 0

    # ------------------------------------------------------------ nodes

    def put_node(self, info: NodeInfo, inventory: Inventory, last_seen: float) -> None:
        """Record a node's info and inventory; keeps its cordon and drain flags."""
        self.put_nodes([(info, inventory, last_seen)])

    def put_nodes(self, nodes: Iterable[tuple[NodeInfo, Inventory, float]]) -> None:
        """put_node for many, in one transaction: ten thousand agents saying Hello after a
        server restart must not cost ten thousand fsyncs."""
        rows = [(info.node_id, _dump(info, NodeInfo), _dump(inv, Inventory), seen)
                for info, inv, seen in nodes]
        if not rows:
            return
        self._tx(lambda tx: tx.many(
            "INSERT INTO nodes (id, info, inventory, last_seen) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET info = excluded.info, "
            "inventory = excluded.inventory, last_seen = excluded.last_seen",
            rows))

    def set_cordoned(self, node_id: str, cordoned: bool, *, draining: bool = False) -> bool:
        """Cordon (optionally draining) or uncordon a node. False if the node is unknown."""
        return self._tx(lambda tx: tx.run(
            "UPDATE nodes SET cordoned = ?, draining = ? WHERE id = ?",
            (int(cordoned or draining), int(draining), node_id))) > 0

    def delete_node(self, node_id: str) -> bool:
        return self._tx(lambda tx: tx.run("DELETE FROM nodes WHERE id = ?", (node_id,))) > 0

    def nodes(self) -> dict[str, StoredNode]:
        rows = self._read(
            "SELECT id, info, inventory, cordoned, draining, last_seen FROM nodes ORDER BY id"
        )
        return {
            nid: StoredNode(
                info=_load(info, NodeInfo),
                inventory=_load(inv, Inventory),
                cordoned=bool(cordoned),
                draining=bool(draining),
                last_seen=float(seen),
            )
            for nid, info, inv, cordoned, draining, seen in rows
        }

    # ------------------------------------------------------------ events

    def add_events(self, events: Iterable[StoredEvent]) -> None:
        evs = list(events)
        if evs:
            self._tx(lambda tx: _insert_events(tx, evs))

    def events(
        self, *, deployment: str | None = None, replica: str | None = None, limit: int = 100
    ) -> list[StoredEvent]:
        """The latest `limit` events (oldest first), for a deployment or a replica."""
        where, args = "", []
        if replica is not None:
            where, args = "WHERE replica = ?", [replica]
        elif deployment is not None:
            where, args = "WHERE deployment = ?", [deployment]
        rows = self._read(
            f"SELECT ts, deployment, replica, text FROM events {where} ORDER BY id DESC LIMIT ?",
            [*args, limit],
        )
        return [StoredEvent(float(ts), d, r, t) for ts, d, r, t in reversed(rows)]

    def trim_events(self, keep: int = 100_000) -> None:
        self._tx(lambda tx: tx.run(
            "DELETE FROM events WHERE id <= (SELECT MAX(id) FROM events) - ?", (keep,)))


    # ------------------------------------------------------------ API keys and usage

    def put_api_key(self, key: ApiKeyRecord, now: float = 0.0) -> None:
        """Create or replace the key named key.name (a name's secret hash may change only by
        replacing it: `ctl apikey create` refuses a name in use)."""
        data = _dump(key, ApiKeyRecord)
        self._tx(lambda tx: tx.run(
            "INSERT INTO api_keys (name, sha256, data, updated) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(name) DO UPDATE SET sha256 = excluded.sha256, data = excluded.data, "
            "updated = excluded.updated", (key.name, key.sha256, data, now)))

    def api_keys(self) -> dict[str, ApiKeyRecord]:
        rows = self._read("SELECT name, data FROM api_keys ORDER BY name")
        return {name: _load(data, ApiKeyRecord) for name, data in rows}

    def add_usage(self, batch_id: str, rows: Iterable[UsageRow], now: float) -> bool:
        """Add a router's batch once: False (nothing added) when `batch_id` was added before."""
        merged = merge(rows)

        def run(tx: Tx) -> bool:
            if tx.rows("SELECT 1 FROM usage_batches WHERE id = ?", (batch_id,)):
                return False
            tx.run("INSERT INTO usage_batches (id, at) VALUES (?, ?)", (batch_id, now))
            if merged:
                tx.many(
                    "INSERT INTO usage (api_key, model, hour, status, requests, prompt_tokens,"
                    " completion_tokens, latency_sum) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT(api_key, model, hour, status) DO UPDATE SET"
                    " requests = usage.requests + excluded.requests,"
                    " prompt_tokens = usage.prompt_tokens + excluded.prompt_tokens,"
                    " completion_tokens = usage.completion_tokens + excluded.completion_tokens,"
                    " latency_sum = usage.latency_sum + excluded.latency_sum",
                    [(r.api_key, r.model, r.hour, r.status, r.requests, r.prompt_tokens,
                      r.completion_tokens, r.latency_sum) for r in merged])
            return True

        return self._tx(run)

    def usage(self, *, api_key: str | None = None, model: str | None = None,
              since: float = 0.0) -> list[UsageRow]:
        """Stored usage rows from the hour holding `since` on, by hour, key, model, status."""
        sql = ("SELECT api_key, model, hour, status, requests, prompt_tokens, completion_tokens,"
               " latency_sum FROM usage WHERE hour >= ?")
        args: list[Any] = [hour_of(since)]
        if api_key is not None:
            sql += " AND api_key = ?"
            args.append(api_key)
        if model is not None:
            sql += " AND model = ?"
            args.append(model)
        rows = self._read(sql + " ORDER BY hour, api_key, model, status", args)
        return [UsageRow(k, m, int(h), int(st), int(n), int(p), int(c), float(lat))
                for k, m, h, st, n, p, c, lat in rows]

    def trim_usage_batches(self, before: float) -> None:
        """Forget batch ids added before `before` (a router retries a batch for minutes at
        most; a day of ids is plenty)."""
        self._tx(lambda tx: tx.run("DELETE FROM usage_batches WHERE at < ?", (before,)))


class _SqliteTx:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def run(self, sql: str, args: Sequence[Any] = ()) -> int:
        return self.db.execute(sql, tuple(args)).rowcount

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self.db.execute(sql, tuple(args)).fetchall()

    def many(self, sql: str, seq: Sequence[Sequence[Any]]) -> None:
        self.db.executemany(sql, seq)


class Store(SqlStore):
    """SQLite: the embedded engine, one server."""

    def __init__(self, path: str) -> None:
        """Open (creating if need be) and migrate the database at `path`."""
        self.path = self.where = path
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except sqlite3.Error as exc:
            raise StoreError(f"{path}: cannot open the state database: {exc}") from None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self, fn: Callable[[Tx], T]) -> T:
        """Run fn inside one committed transaction."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    out = fn(_SqliteTx(self._db))
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
                return out
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: {exc}") from None

    def _read(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return self._db.execute(sql, tuple(args)).fetchall()
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: {exc}") from None

    def _migrate(self) -> None:
        db = self._db
        db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = db.execute("SELECT version FROM schema_version").fetchone()
        try:
            todo = migrations.steps(migrations.SQLITE, int(row[0]) if row else 0)
        except ValueError as exc:
            raise StoreError(f"{self.path}: {exc}") from None
        for target, stmts in todo:
            db.execute("BEGIN IMMEDIATE")
            try:
                for stmt in stmts:
                    db.execute(stmt)
                db.execute("DELETE FROM schema_version")
                db.execute("INSERT INTO schema_version (version) VALUES (?)", (target,))
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")


SqliteStore = Store


def _insert_events(tx: Tx, events: list[StoredEvent]) -> None:
    if events:
        tx.many(
            "INSERT INTO events (ts, deployment, replica, text) VALUES (?, ?, ?, ?)",
            [(e.ts, e.deployment, e.replica, e.text) for e in events],
        )


def _set_meta(tx: Tx, key: str, value: str) -> None:
    tx.run(
        "INSERT INTO meta (key, value) VALUES (?, ?) "
        "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
        (key, value),
    )

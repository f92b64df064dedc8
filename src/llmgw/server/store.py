"""The server's durable state: SQLite in WAL mode with synchronous=FULL.

Deployments, replicas (assignments with generations), nodes (info, last inventory,
cordon/drain flags), an event log, and a small meta table (the generation floor).
A method that returns has committed: what ctl was told succeeded survives a SIGKILL.

The API is synchronous; the trio service calls it through `trio.to_thread.run_sync`,
one call at a time (a lock guards the connection all the same).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from attrs import frozen
from cattrs.preconf.json import make_converter

from llmgw.errors import LlmgwError
from llmgw.model.deployment import Deployment, Replica
from llmgw.model.inventory import Inventory, NodeInfo

T = TypeVar("T")

SCHEMA_VERSION = 1

# Migration N takes a database at version N-1 to version N.
_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        "CREATE TABLE deployments (name TEXT PRIMARY KEY, spec TEXT NOT NULL,"
        " updated REAL NOT NULL DEFAULT 0)",
        "CREATE TABLE replicas (id TEXT PRIMARY KEY, deployment TEXT NOT NULL,"
        " generation INTEGER NOT NULL, data TEXT NOT NULL)",
        "CREATE INDEX replicas_by_deployment ON replicas (deployment)",
        "CREATE TABLE nodes (id TEXT PRIMARY KEY, info TEXT NOT NULL, inventory TEXT NOT NULL,"
        " cordoned INTEGER NOT NULL DEFAULT 0, draining INTEGER NOT NULL DEFAULT 0,"
        " last_seen REAL NOT NULL DEFAULT 0)",
        "CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL,"
        " deployment TEXT NOT NULL DEFAULT '', replica TEXT NOT NULL DEFAULT '',"
        " text TEXT NOT NULL)",
        "CREATE INDEX events_by_deployment ON events (deployment, id)",
        "CREATE INDEX events_by_replica ON events (replica, id)",
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    ),
}


class StoreError(LlmgwError):
    """The state database cannot be opened, read or migrated."""

    exit_code = 2


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


def _dump(obj: Any, cls: type) -> str:
    return json.dumps(_conv.unstructure(obj, cls), separators=(",", ":"), sort_keys=True)


def plain(obj: Any, cls: type) -> Any:
    """`obj` as plain data (dicts, lists, strings, numbers), the way the store keeps it."""
    return _conv.unstructure(obj, cls)


def _load(text: str, cls: type[T]) -> T:
    return _conv.structure(json.loads(text), cls)


class Store:
    def __init__(self, path: str) -> None:
        """Open (creating if need be) and migrate the database at `path`."""
        self.path = path
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except sqlite3.Error as exc:
            raise StoreError(f"{path}: cannot open the state database: {exc}") from None

    # ------------------------------------------------------------ plumbing

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _tx(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run fn inside one committed transaction."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    out = fn(self._db)
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
                return out
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: {exc}") from None

    def _read(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return self._db.execute(sql, tuple(args)).fetchall()
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: {exc}") from None

    def schema_version(self) -> int:
        rows = self._read("SELECT version FROM schema_version")
        return int(rows[0][0]) if rows else 0

    def _migrate(self) -> None:
        db = self._db
        db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = db.execute("SELECT version FROM schema_version").fetchone()
        version = int(row[0]) if row else 0
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path}: schema version {version} is newer than this llmgw "
                f"understands ({SCHEMA_VERSION}); upgrade llmgw"
            )
        for target in range(version + 1, SCHEMA_VERSION + 1):
            db.execute("BEGIN IMMEDIATE")
            try:
                for stmt in _MIGRATIONS[target]:
                    db.execute(stmt)
                db.execute("DELETE FROM schema_version")
                db.execute("INSERT INTO schema_version (version) VALUES (?)", (target,))
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    # ------------------------------------------------------------ deployments

    def put_deployment(self, d: Deployment, now: float = 0.0) -> None:
        spec = _dump(d, Deployment)
        self._tx(
            lambda db: db.execute(
                "INSERT INTO deployments (name, spec, updated) VALUES (?, ?, ?) "
                "ON CONFLICT(name) DO UPDATE SET spec = excluded.spec, updated = excluded.updated",
                (d.name, spec, now),
            )
        )

    def delete_deployment(self, name: str) -> bool:
        """Forget a deployment (its replicas go when reconcile says so). True if it existed."""
        cur = self._tx(lambda db: db.execute("DELETE FROM deployments WHERE name = ?", (name,)))
        return cur.rowcount > 0

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

        def run(db: sqlite3.Connection) -> None:
            have = {row[0]: row[1] for row in db.execute("SELECT id, data FROM replicas")}
            for rid in have.keys() - replicas.keys():
                db.execute("DELETE FROM replicas WHERE id = ?", (rid,))
            for rid, r in replicas.items():
                data = _dump(r, Replica)
                if have.get(rid) != data:
                    db.execute(
                        "INSERT OR REPLACE INTO replicas (id, deployment, generation, data) "
                        "VALUES (?, ?, ?, ?)",
                        (rid, r.deployment, r.generation, data),
                    )
            _insert_events(db, evs)
            if generation_floor is not None:
                _set_meta(db, "generation_floor", str(generation_floor))

        self._tx(run)

    def state_id(self) -> str:
        """A random id made with this state (once, kept in meta): engines carry the id of
        the state that issued them, so a server can tell its own from a lost state's."""
        rows = self._read("SELECT value FROM meta WHERE key = 'state_id'")
        if rows:
            return str(rows[0][0])
        new = uuid.uuid4().hex
        self._tx(lambda db: _set_meta(db, "state_id", new))
        return new

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
        self._tx(
            lambda db: db.executemany(
                "INSERT INTO nodes (id, info, inventory, last_seen) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET info = excluded.info, "
                "inventory = excluded.inventory, last_seen = excluded.last_seen",
                rows,
            )
        )

    def set_cordoned(self, node_id: str, cordoned: bool, *, draining: bool = False) -> bool:
        """Cordon (optionally draining) or uncordon a node. False if the node is unknown."""
        cur = self._tx(
            lambda db: db.execute(
                "UPDATE nodes SET cordoned = ?, draining = ? WHERE id = ?",
                (int(cordoned or draining), int(draining), node_id),
            )
        )
        return cur.rowcount > 0

    def delete_node(self, node_id: str) -> bool:
        cur = self._tx(lambda db: db.execute("DELETE FROM nodes WHERE id = ?", (node_id,)))
        return cur.rowcount > 0

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
        self._tx(lambda db: _insert_events(db, evs))

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
        self._tx(
            lambda db: db.execute(
                "DELETE FROM events WHERE id <= (SELECT MAX(id) FROM events) - ?", (keep,)
            )
        )


def _insert_events(db: sqlite3.Connection, events: list[StoredEvent]) -> None:
    db.executemany(
        "INSERT INTO events (ts, deployment, replica, text) VALUES (?, ?, ?, ?)",
        [(e.ts, e.deployment, e.replica, e.text) for e in events],
    )


def _set_meta(db: sqlite3.Connection, key: str, value: str) -> None:
    db.execute(
        "INSERT INTO meta (key, value) VALUES (?, ?) "
        "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
        (key, value),
    )

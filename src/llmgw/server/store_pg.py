"""The state on PostgreSQL (psycopg 3): the queries of store.SqlStore, the lease of
leader.py, and fencing.

Synchronous connections, called through `trio.to_thread.run_sync` like the SQLite store:
psycopg's async API needs asyncio, and one round trip costs about what SQLite's fsync
does. Two connections per server: one for the state, one for the lease alone, so that a
renewal never waits behind a pass's writes.

Fencing: once `fence` is set (by the leader shell, to the epoch it won), every write
transaction first locks the lease row FOR SHARE and checks that the epoch is still this
server's and the lease has not run out, by the database's clock. A takeover updates that
row, so it waits for a write already under way to commit, and every write after it sees
the new epoch and is refused (FencedError): a paused or partitioned old leader can never
overwrite its successor's state.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg

from llmgw.config.server import StoreConfig
from llmgw.server import migrations
from llmgw.server.store import FencedError, SqlStore, StoreError, Tx

T = TypeVar("T")

# The database's clock in seconds: leases are judged by it alone, so the servers' own
# clocks never need to agree. clock_timestamp(), not now(): now() is the start of the
# transaction.
DB_NOW = "EXTRACT(EPOCH FROM clock_timestamp())::float8"
# pg_advisory_xact_lock key that serializes migrations of servers starting together.
_MIGRATE_LOCK = 0x6C6C6D6777  # "llmgw"


def redact(url: str) -> str:
    """The url without its password, for logs and errors."""
    url = re.sub(r"(//[^:/@]*):[^@/]*@", r"\1:***@", url)
    return re.sub(r"(password=)[^&\s]*", r"\1***", url)


def _q(sql: str) -> str:
    # Queries are written with SQLite's `?`; none of them holds a literal ? or %.
    return sql.replace("?", "%s")


class _PgTx:
    def __init__(self, cur: psycopg.Cursor[Any]) -> None:
        self.cur = cur

    def run(self, sql: str, args: Sequence[Any] = ()) -> int:
        self.cur.execute(_q(sql), tuple(args))
        return self.cur.rowcount

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self.cur.execute(_q(sql), tuple(args))
        return self.cur.fetchall()

    def many(self, sql: str, seq: Sequence[Sequence[Any]]) -> None:
        self.cur.executemany(_q(sql), seq)


class _Conn:
    """One connection, opened on first use and again after it broke (a database restart):
    the caller gets a StoreError for the call that met the break, and the next call
    reconnects."""

    def __init__(self, url: str, password: str | None, connect_timeout: float,
                 lease: float) -> None:
        self.url = url
        self.where = redact(url)
        self.kwargs: dict[str, Any] = {
            "autocommit": True,
            "connect_timeout": max(1, round(connect_timeout)),
            # A partitioned database must not hang a thread for TCP's fifteen minutes.
            "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3,
            "options": f"-c statement_timeout={int(max(lease, 2.0) * 1000)}",
        }
        if password is not None:
            self.kwargs["password"] = password
        if not url.startswith(("postgresql:///", "postgres:///")) and "host=/" not in url:
            self.kwargs["tcp_user_timeout"] = int(max(lease, 2.0) * 1000)
        self.lock = threading.Lock()
        self.conn: psycopg.Connection[Any] | None = None

    def get(self) -> psycopg.Connection[Any]:
        if self.conn is None or self.conn.closed or self.conn.broken:
            self.drop()
            self.conn = psycopg.connect(self.url, **self.kwargs)
        return self.conn

    def drop(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except psycopg.Error as exc:  # already gone: nothing to release
                self.conn = None
                raise StoreError(f"{self.where}: {exc}") from None
            self.conn = None

    def call(self, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        with self.lock:
            try:
                return fn(self.get())
            except psycopg.Error as exc:
                if self.conn is not None and (self.conn.broken or self.conn.closed):
                    self.conn = None
                raise StoreError(f"{self.where}: {_first_line(exc)}") from None

    def close(self) -> None:
        with self.lock:
            conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def read_password(cfg: StoreConfig) -> str | None:
    if cfg.password_file:
        try:
            with open(cfg.password_file) as f:
                return f.read().rstrip("\r\n")
        except OSError as exc:
            raise StoreError(f"{cfg.password_file}: cannot read the database password: "
                             f"{exc.strerror or exc}") from None
    if cfg.password_env:
        value = os.environ.get(cfg.password_env)
        if not value:
            raise StoreError(f"${cfg.password_env} (store.password_env) is not set")
        return value
    return None  # libpq's own: ~/.pgpass, PGPASSWORD, peer authentication


class PgStore(SqlStore):
    """PostgreSQL: shared by several servers; writes fenced by the leader's epoch."""

    def __init__(self, url: str, *, password: str | None = None, connect_timeout: float = 5.0,
                 lease: float = 10.0) -> None:
        """Connect and migrate (StoreError when the database cannot be reached)."""
        self._db = _Conn(url, password, connect_timeout, lease)
        self.where = self._db.where
        self.url, self.password, self.connect_timeout, self.lease = url, password, connect_timeout, lease
        # (epoch, holder) this server leads with; None: writes are not fenced (tests, tools).
        self.fence: tuple[int, str] | None = None
        self.fenced = False  # a write was refused by the epoch check: step down
        try:
            self._db.call(self._migrate)
        except BaseException:
            self._db.close()
            raise

    @classmethod
    def from_config(cls, cfg: StoreConfig) -> PgStore:
        return cls(cfg.url, password=read_password(cfg), connect_timeout=cfg.connect_timeout,
                   lease=cfg.lease)

    def lease_connection(self) -> PgLease:
        """A second connection to the same database, for the lease alone."""
        return PgLease(_Conn(self.url, self.password, self.connect_timeout, self.lease))

    def close(self) -> None:
        self._db.close()

    def _migrate(self, conn: psycopg.Connection[Any]) -> None:
        with conn.transaction():
            # Servers starting together: one migrates, the others wait and find it done.
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATE_LOCK,))
            conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = conn.execute("SELECT version FROM schema_version").fetchone()
            try:
                todo = migrations.steps(migrations.POSTGRES, int(row[0]) if row else 0)
            except ValueError as exc:
                raise StoreError(f"{self.where}: {exc}") from None
            for target, stmts in todo:
                for stmt in stmts:
                    conn.execute(stmt)
                conn.execute("DELETE FROM schema_version")
                conn.execute("INSERT INTO schema_version (version) VALUES (%s)", (target,))

    def _tx(self, fn: Callable[[Tx], T]) -> T:
        fence = self.fence

        def run(conn: psycopg.Connection[Any]) -> T:
            with conn.transaction(), conn.cursor() as cur:
                if fence is not None:
                    self._check_fence(cur, fence)
                return fn(_PgTx(cur))

        return self._db.call(run)

    def _check_fence(self, cur: psycopg.Cursor[Any], fence: tuple[int, str]) -> None:
        cur.execute(f"SELECT epoch, holder, expires > {DB_NOW} FROM leader WHERE id = 1 FOR SHARE")
        row = cur.fetchone()
        if row is None or (int(row[0]), str(row[1])) != fence or not row[2]:
            self.fenced = True
            now = f"epoch {row[0]}" if row is not None else "no lease row"
            raise FencedError(
                f"{self.where}: write refused: this server led with epoch {fence[0]}, "
                f"the lease now says {now}{'' if row is None or row[2] else ' (expired)'}"
            )

    def _read(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self._db.call(lambda conn: conn.execute(_q(sql), tuple(args)).fetchall())


class PgLease:
    """The lease row's operations (leader.py decides when to call them), each one short
    statement judged by the database's clock."""

    def __init__(self, conn: _Conn) -> None:
        self._db = conn

    def close(self) -> None:
        self._db.close()

    def acquire(self, holder: str, address: str, ttl: float) -> int | None:
        """Take the lease if it is free or has run out: the new epoch, or None."""
        def run(conn: psycopg.Connection[Any]) -> int | None:
            row = conn.execute(
                f"UPDATE leader SET epoch = epoch + 1, holder = %s, address = %s, "
                f"expires = {DB_NOW} + %s WHERE id = 1 AND expires <= {DB_NOW} RETURNING epoch",
                (holder, address, ttl)).fetchone()
            return int(row[0]) if row else None
        return self._db.call(run)

    def renew(self, epoch: int, holder: str, ttl: float) -> bool:
        """Extend our lease; False if it is no longer ours (or ran out before we renewed)."""
        def run(conn: psycopg.Connection[Any]) -> bool:
            cur = conn.execute(
                f"UPDATE leader SET expires = {DB_NOW} + %s WHERE id = 1 AND epoch = %s "
                f"AND holder = %s AND expires > {DB_NOW}", (ttl, epoch, holder))
            return cur.rowcount == 1
        return self._db.call(run)

    def release(self, epoch: int, holder: str) -> None:
        """Give the lease up now (a clean stop): a standby need not wait for it to run out."""
        self._db.call(lambda conn: conn.execute(
            "UPDATE leader SET expires = 0 WHERE id = 1 AND epoch = %s AND holder = %s",
            (epoch, holder)))

    def current(self) -> tuple[int, str, str, bool]:
        """(epoch, holder, address, live) as the database has it now."""
        def run(conn: psycopg.Connection[Any]) -> tuple[int, str, str, bool]:
            row = conn.execute(
                f"SELECT epoch, holder, address, expires > {DB_NOW} FROM leader WHERE id = 1").fetchone()
            if row is None:
                return 0, "", "", False
            return int(row[0]), str(row[1]), str(row[2]), bool(row[3])
        return self._db.call(run)

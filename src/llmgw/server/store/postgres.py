"""The state on PostgreSQL (psycopg 3): the queries of store.SqlStore, the lease of
ha.py, and fencing.

Synchronous connections, called through `trio.to_thread.run_sync` like the SQLite store:
psycopg's async API needs asyncio, and one round trip costs about what SQLite's fsync
does. Two connections per server: one for the state, one for the lease alone, so that a
renewal never waits behind a pass's writes.

Fencing takes no lock that a takeover could wait on (failover past a frozen leader: a leader frozen inside a
write held the lease row FOR SHARE, and every standby's takeover waited for it for as long
as it was frozen). Instead:

- every write transaction first *reads* the lease row (a plain read: no row lock) and is
  refused (FencedError) unless the epoch is still this server's and the lease has not run
  out, by the database's clock;
- the session that writes carries its epoch in `application_name` ("llmgw e<epoch> …");
- the takeover is one UPDATE of the lease row that waits on nothing, and the new leader
  then ends every session that carries the old epoch (`pg_terminate_backend`, which rolls
  back the transaction it holds) and starts its term only once none is left
  (`PgLease.end_term`). A write of the old leader is therefore either committed before
  the new term reads the state, or rolled back; any later one reads the new epoch and is
  refused;
- every connection has `statement_timeout` and `idle_in_transaction_session_timeout`
  below the lease, so even where a session cannot be terminated (another role without
  pg_signal_backend) nothing the old leader holds outlives its lease.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg

from llmgw.config.server import StoreConfig
from llmgw.server.store import migrations
from llmgw.server.store.sql import FencedError, SqlStore, StoreError, Tx

T = TypeVar("T")

log = logging.getLogger(__name__)

# The database's clock in seconds: leases are judged by it alone, so the servers' own
# clocks never need to agree. clock_timestamp(), not now(): now() is the start of the
# transaction.
DB_NOW = "EXTRACT(EPOCH FROM clock_timestamp())::float8"
# pg_advisory_xact_lock key that serializes migrations of servers starting together.
_MIGRATE_LOCK = 0x6C6C6D6777  # "llmgw"
# Called with each statement of a fenced transaction before it runs; given to PgStore by
# whoever builds it (None in the server). The failover tests stop the process there, as a
# frozen VM would stop a leader mid-write (tests/fakes/frozen_server.py).
StatementHook = Callable[[str], None]


def session_timeout_ms(lease: float) -> int:
    """statement_timeout and idle_in_transaction_session_timeout of every connection: half
    the lease, so that whatever a frozen or cut-off leader holds is ended by the database
    before its lease can pass to another server."""
    return int(max(lease / 2, 0.25) * 1000)


def epoch_tag(epoch: int) -> str:
    """The start of `application_name` of the sessions that write under `epoch`."""
    return f"llmgw e{epoch} "


def redact(url: str) -> str:
    """The url without its password, for logs and errors."""
    url = re.sub(r"(//[^:/@]*):[^@/]*@", r"\1:***@", url)
    return re.sub(r"(password=)[^&\s]*", r"\1***", url)


def _q(sql: str) -> str:
    # Queries are written with SQLite's `?`; none of them holds a literal ? or %.
    return sql.replace("?", "%s")


class _PgTx:
    def __init__(self, cur: psycopg.Cursor[Any], hook: StatementHook | None = None) -> None:
        self.cur = cur
        self.hook = hook

    def run(self, sql: str, args: Sequence[Any] = ()) -> int:
        if self.hook is not None:
            self.hook(sql)
        self.cur.execute(_q(sql), tuple(args))
        return self.cur.rowcount

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        if self.hook is not None:
            self.hook(sql)
        self.cur.execute(_q(sql), tuple(args))
        return self.cur.fetchall()

    def many(self, sql: str, seq: Sequence[Sequence[Any]]) -> None:
        if self.hook is not None:
            self.hook(sql)
        self.cur.executemany(_q(sql), seq)


class _Conn:
    """One connection, opened on first use and again after it broke (a database restart):
    the caller gets a StoreError for the call that met the break, and the next call
    reconnects."""

    def __init__(self, url: str, password: str | None, connect_timeout: float,
                 lease: float, app_name: str = "llmgw") -> None:
        self.url = url
        self.where = redact(url)
        ms = session_timeout_ms(lease)
        self.kwargs: dict[str, Any] = {
            "autocommit": True,
            "connect_timeout": max(1, round(connect_timeout)),
            # A partitioned database must not hang a thread for TCP's fifteen minutes.
            "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3,
            "options": f"-c statement_timeout={ms} -c idle_in_transaction_session_timeout={ms}",
        }
        # What pg_stat_activity shows for this session; set again (one statement) before the
        # next call whenever it changes, so a new term's writes carry the new epoch.
        self.app_name = app_name
        self._applied = ""
        if password is not None:
            self.kwargs["password"] = password
        if not url.startswith(("postgresql:///", "postgres:///")) and "host=/" not in url:
            self.kwargs["tcp_user_timeout"] = int(max(lease, 2.0) * 1000)
        self.lock = threading.Lock()
        self.conn: psycopg.Connection[Any] | None = None

    def get(self) -> psycopg.Connection[Any]:
        if self.conn is None or self.conn.closed or self.conn.broken:
            self.drop()
            name = self.app_name
            self.conn = psycopg.connect(self.url, application_name=name[:63], **self.kwargs)
            self._applied = name
        if self._applied != self.app_name:
            name = self.app_name
            self.conn.execute("SELECT set_config('application_name', %s, false)", (name[:63],))
            self._applied = name
        return self.conn

    def abort(self) -> None:
        """Shut the connection's socket down under whatever thread is blocked on it (no
        lock: that thread holds it), so that the call returns at once with an error. For a
        leader stepping down: a write sent into a silent network (every packet lost, the
        connection open) would otherwise wait for the database that will never answer."""
        conn = self.conn
        if conn is None or conn.closed:
            return
        try:
            fd = os.dup(conn.fileno())
        except (OSError, psycopg.Error) as exc:
            log.debug("no socket to shut down: %s", exc)
            return
        s = socket.socket(fileno=fd)
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError as exc:  # not connected any more: nothing is blocked on it
            log.debug("shutdown of the database socket: %s", exc)
        finally:
            s.close()

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
                 lease: float = 10.0, before_statement: StatementHook | None = None) -> None:
        """Connect and migrate (StoreError when the database cannot be reached).
        `before_statement`: called with each statement of a fenced transaction before it
        runs (tests)."""
        self._db = _Conn(url, password, connect_timeout, lease)
        self.where = self._db.where
        self.url, self.password, self.connect_timeout, self.lease = url, password, connect_timeout, lease
        self._fence: tuple[int, str] | None = None
        self.fenced = False  # a write was refused by the epoch check: step down
        self.fenced_why = ""  # that refusal, in words
        self.fenced_leader = ""  # the address the lease row named then, if it was live
        self._before_statement = before_statement
        try:
            self._db.call(self._migrate)
        except BaseException:
            self._db.close()
            raise

    @property
    def fence(self) -> tuple[int, str] | None:
        """(epoch, holder) this server leads with; None: writes are not fenced (a standby,
        tests, tools). Setting it tags this store's session with the epoch."""
        return self._fence

    @fence.setter
    def fence(self, value: tuple[int, str] | None) -> None:
        self._fence = value
        self._db.app_name = (f"{epoch_tag(value[0])}{value[1][:16]}" if value is not None
                             else "llmgw standby")

    def abort(self) -> None:
        """The term is over: a call blocked on the database returns now, with an error."""
        self._db.abort()

    @classmethod
    def from_config(cls, cfg: StoreConfig) -> PgStore:
        return cls(cfg.url, password=read_password(cfg), connect_timeout=cfg.connect_timeout,
                   lease=cfg.lease)

    def lease_connection(self) -> PgLease:
        """A second connection to the same database, for the lease alone."""
        return PgLease(_Conn(self.url, self.password, self.connect_timeout, self.lease,
                             "llmgw lease"))

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
                return fn(_PgTx(cur, self._before_statement if fence is not None else None))

        try:
            return self._db.call(run)
        except FencedError as exc:
            log.warning("%s", exc)
            raise
        except StoreError:
            if fence is None or self._db.conn is not None:
                raise
            # The connection broke under a fenced write: most likely the server that took
            # over ended this session. Say so if the lease row agrees (one more round trip).
            try:
                self._db.call(lambda conn: self._check_fence(conn.cursor(), fence))
            except FencedError as exc:
                refused = FencedError(f"{exc} (its transaction was ended and rolled back: "
                                      "another server took over)")
                self.fenced_why = str(refused)
                log.warning("%s", refused)
                raise refused from None
            except StoreError as again:
                log.debug("the fence could not be checked again: %s", again)
            raise

    def _check_fence(self, cur: psycopg.Cursor[Any], fence: tuple[int, str]) -> None:
        # A plain read, no FOR SHARE: a takeover must never wait for this transaction
        # (the module's docstring says what makes that safe).
        cur.execute(f"SELECT epoch, holder, address, expires > {DB_NOW} FROM leader WHERE id = 1")
        row = cur.fetchone()
        if row is None or (int(row[0]), str(row[1])) != fence or not row[3]:
            self.fenced = True
            self.fenced_leader = str(row[2]) if row is not None and row[3] else ""
            now = f"epoch {row[0]}" if row is not None else "no lease row"
            self.fenced_why = (
                f"{self.where}: write refused: this server led with epoch {fence[0]}, "
                f"the lease now says {now}{'' if row is None or row[3] else ' (expired)'}")
            raise FencedError(self.fenced_why)

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

    def end_term(self, epoch: int, wait: float) -> int:
        """End every session that wrote (or may still write) under `epoch`, the term just
        taken over, and return once none of them is inside a transaction: how many were
        ended. Their open transactions are rolled back, so the new term reads a state that
        nothing of the old one can change any more. StoreError if one is still in a
        transaction after `wait` seconds (not allowed to end it, and its timeouts have not
        fired yet): the new term must not start."""
        like = epoch_tag(epoch) + "%"

        def run(conn: psycopg.Connection[Any]) -> int:
            pids = [int(r[0]) for r in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s "
                "AND pid <> pg_backend_pid()", (like,)).fetchall()]
            ended = 0
            for pid in pids:
                try:
                    ended += bool(conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0])  # type: ignore[index]
                except psycopg.errors.InsufficientPrivilege as exc:
                    # Another role: its idle_in_transaction_session_timeout ends it instead.
                    log.warning("cannot end session %d of epoch %d: %s", pid, epoch, _first_line(exc))
            until = time.monotonic() + wait
            while True:
                left = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s "
                    "AND pid <> pg_backend_pid() AND xact_start IS NOT NULL", (like,)).fetchone()
                if left is None or int(left[0]) == 0:
                    return ended
                if time.monotonic() >= until:
                    raise StoreError(f"{self._db.where}: {int(left[0])} session(s) of epoch {epoch} "
                                     f"still in a transaction after {wait:g}s")
                time.sleep(0.02)

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

"""PostgreSQL's own behaviour: migrations of servers starting together, a newer schema,
the lease row, fencing by epoch, and a database restart under an open store."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from fakes.postgres import PgServer
from llmgw.server.store import SCHEMA_VERSION, FencedError, StoredEvent, StoreError
from llmgw.server.store_pg import PgStore, redact


def test_servers_starting_together_migrate_once(pg_url: str) -> None:
    stores: list[PgStore] = []
    errors: list[BaseException] = []

    def open_one() -> None:
        try:
            stores.append(PgStore(pg_url))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and len(stores) == 4
    assert all(s.schema_version() == SCHEMA_VERSION for s in stores)
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT count(*) FROM schema_version").fetchone() == (1,)
    for s in stores:
        s.close()


def test_newer_schema_is_refused(pg_url: str) -> None:
    PgStore(pg_url).close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE schema_version SET version = 999")
    with pytest.raises(StoreError, match="newer"):
        PgStore(pg_url)


def test_unreachable_database_is_a_store_error_without_the_password() -> None:
    with pytest.raises(StoreError) as info:
        PgStore("postgresql://u:s3cret@127.0.0.1:1/db", connect_timeout=1)
    assert "s3cret" not in str(info.value)
    assert redact("postgresql://u:s3cret@h/db") == "postgresql://u:***@h/db"
    assert redact("postgresql://h/db?password=s3cret&x=1") == "postgresql://h/db?password=***&x=1"


def test_lease_one_holder_at_a_time_and_expiry(pg_url: str) -> None:
    with PgStore(pg_url) as store:
        a, b = store.lease_connection(), store.lease_connection()
        try:
            ea = a.acquire("a", "tcp://a:1", 1.0)
            assert ea == 1
            assert b.acquire("b", "tcp://b:1", 1.0) is None  # held
            assert a.renew(1, "a", 1.0) and not b.renew(1, "b", 1.0)
            assert a.current() == (1, "a", "tcp://a:1", True)
            time.sleep(1.2)  # a stops renewing: the lease runs out by the database's clock
            assert not a.renew(1, "a", 1.0)
            assert b.acquire("b", "tcp://b:1", 5.0) == 2
            assert b.current()[:3] == (2, "b", "tcp://b:1")
            b.release(2, "b")
            assert not b.current()[3]
            assert a.acquire("a", "tcp://a:1", 5.0) == 3  # released: no wait
        finally:
            a.close()
            b.close()


def test_writes_of_a_superseded_leader_are_refused(pg_url: str) -> None:
    old, new = PgStore(pg_url), PgStore(pg_url)
    la, lb = old.lease_connection(), new.lease_connection()
    try:
        e1 = la.acquire("old", "tcp://old:1", 1.0)
        assert e1 is not None
        old.fence = (e1, "old")
        old.add_events([StoredEvent(1.0, "d", "", "by the old leader")])
        time.sleep(1.2)
        # Its lease ran out: refused even before anyone takes over.
        with pytest.raises(FencedError, match="expired"):
            old.add_events([StoredEvent(2.0, "d", "", "too late")])
        e2 = lb.acquire("new", "tcp://new:1", 10.0)
        assert e2 == e1 + 1
        new.fence = (e2, "new")
        new.add_events([StoredEvent(3.0, "d", "", "by the new leader")])
        assert not la.renew(e1, "old", 1.0)
        with pytest.raises(FencedError, match=f"epoch {e2}"):
            old.save_replicas({}, events=[StoredEvent(4.0, "d", "", "stale")])
        assert old.fenced and not new.fenced
        assert [e.text for e in new.events()] == ["by the old leader", "by the new leader"]
    finally:
        for c in (la, lb, old, new):
            c.close()


def test_a_takeover_waits_for_a_write_under_way(pg_url: str) -> None:
    """The fence check locks the lease row: a takeover cannot slip between the check and
    the commit of the old leader's write."""
    old = PgStore(pg_url)
    la, lb = old.lease_connection(), old.lease_connection()
    try:
        e1 = la.acquire("old", "tcp://old:1", 1.0)
        assert e1 is not None
        old.fence = (e1, "old")
        took: list[float] = []
        started = threading.Event()

        def slow_write(tx: object) -> None:
            started.set()
            time.sleep(1.5)  # the lease runs out meanwhile

        def takeover() -> None:
            started.wait(5)
            while lb.acquire("new", "tcp://new:1", 10.0) is None:
                time.sleep(0.05)
            took.append(time.monotonic())

        t = threading.Thread(target=takeover)
        t.start()
        old._tx(slow_write)  # type: ignore[arg-type]
        done = time.monotonic()
        t.join(10)
        assert took and took[0] >= done - 0.05
    finally:
        for c in (la, lb, old):
            c.close()


def test_database_restart_fails_one_call_then_reconnects(pg_server: PgServer) -> None:
    url = pg_server.new_database()
    with PgStore(url) as s:
        s.add_events([StoredEvent(1.0, "d", "", "before")])
        pg_server.restart()
        # The connection died with the restart: this call fails (StoreError), never hangs
        # nor half-writes; a later one reconnects.
        try:
            s.add_events([StoredEvent(2.0, "d", "", "during")])
            first_ok = True
        except StoreError:
            first_ok = False
        s.add_events([StoredEvent(3.0, "d", "", "after")])
        texts = [e.text for e in s.events()]
        assert texts == (["before", "during", "after"] if first_ok else ["before", "after"])

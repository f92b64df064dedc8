"""PostgreSQL's own behaviour: migrations of servers starting together, a newer schema,
the lease row, fencing by epoch (a takeover that never waits on the old leader, the old
epoch's sessions ended, timeouts below the lease), and a database restart under an open
store."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from fakes.postgres import PgServer
from llmgw.server.store.postgres import PgStore, epoch_tag, redact
from llmgw.server.store.sql import SCHEMA_VERSION, FencedError, StoredEvent, StoreError


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


def test_a_takeover_never_waits_for_a_write_under_way(pg_url: str) -> None:
    """Issue 19: the old leader is stuck inside a write transaction (frozen, cut off). The
    takeover goes through at once once the lease has run out, ends the old epoch's session
    (its transaction rolled back), and the old write, resumed, is refused by the fence."""
    old = PgStore(pg_url)
    la, lb = old.lease_connection(), old.lease_connection()
    try:
        e1 = la.acquire("old", "tcp://old:1", 1.0)
        assert e1 is not None
        old.fence = (e1, "old")
        started, resume = threading.Event(), threading.Event()
        outcome: list[BaseException | None] = []

        def stuck_write(tx: Any) -> None:
            tx.run("INSERT INTO events (ts, deployment, replica, text) VALUES (?, ?, ?, ?)",
                   (1.0, "d", "", "written by a frozen leader"))
            started.set()
            resume.wait(10)  # frozen, inside the transaction, past its lease
            tx.run("INSERT INTO events (ts, deployment, replica, text) VALUES (?, ?, ?, ?)",
                   (2.0, "d", "", "after waking"))

        def old_leader() -> None:
            try:
                old._tx(stuck_write)
                outcome.append(None)
            except BaseException as exc:  # looked at below
                outcome.append(exc)

        t = threading.Thread(target=old_leader)
        t.start()
        assert started.wait(5)
        t0 = time.monotonic()
        while (e2 := lb.acquire("new", "tcp://new:1", 10.0)) is None:
            assert time.monotonic() - t0 < 3, "the takeover waited for the old leader's write"
            time.sleep(0.05)
        took = time.monotonic() - t0
        assert e2 == e1 + 1 and took < 1.5, took  # the lease's 1 s, never the write
        assert lb.end_term(e1, 2.0) == 1  # the frozen leader's session, ended
        resume.set()
        t.join(10)
        assert len(outcome) == 1 and isinstance(outcome[0], FencedError), outcome
        assert "ended and rolled back: another server took over" in str(outcome[0])
        assert old.fenced and f"epoch {e2}" in old.fenced_why
        assert old.events() == []  # rolled back: nothing of the old term's write is left
        lb.end_term(e1, 1.0)  # again: no session of epoch 1 is in a transaction
    finally:
        for c in (la, lb, old):
            c.close()


def test_sessions_end_themselves_below_the_lease(pg_url: str) -> None:
    """A leader that stops inside a transaction loses it to the database's own timeouts
    (half the lease) before the lease can pass: nothing it holds outlives its lease."""
    with PgStore(pg_url, lease=2.0) as store:
        rows = store._read("SELECT current_setting('statement_timeout'), "
                           "current_setting('idle_in_transaction_session_timeout')")
        assert rows == [("1s", "1s")]
        lease = store.lease_connection()
        try:
            assert lease._db.call(lambda c: c.execute(
                "SELECT current_setting('idle_in_transaction_session_timeout')").fetchone()) == ("1s",)
        finally:
            lease.close()

        def idle_in_transaction(tx: Any) -> None:
            tx.run("INSERT INTO meta (key, value) VALUES ('k', 'v')")
            time.sleep(1.5)
            tx.run("SELECT 1")

        with pytest.raises(StoreError):
            store._tx(idle_in_transaction)
        assert store._read("SELECT value FROM meta WHERE key = 'k'") == []


def test_writing_sessions_carry_their_epoch(pg_url: str) -> None:
    with PgStore(pg_url) as store, psycopg.connect(pg_url, autocommit=True) as watch:
        def names() -> list[str]:
            return [r[0] for r in watch.execute(
                "SELECT application_name FROM pg_stat_activity WHERE application_name LIKE 'llmgw%' "
                "AND pid <> pg_backend_pid()").fetchall()]

        lease = store.lease_connection()
        epoch = lease.acquire("holder-of-one", "tcp://a:1", 10.0)
        assert epoch == 1
        store.fence = (epoch, "holder-of-one")
        store.add_events([StoredEvent(1.0, "d", "", "x")])
        assert sorted(names()) == [f"{epoch_tag(1)}holder-of-one", "llmgw lease"]
        lease.close()
        store.fence = None
        store.events()
        wait_until = time.monotonic() + 5  # the closed lease session may linger a moment
        while "llmgw lease" in names() and time.monotonic() < wait_until:
            time.sleep(0.05)
        assert names() == ["llmgw standby"]


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

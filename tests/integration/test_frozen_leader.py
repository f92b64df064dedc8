"""A leader frozen inside a write transaction (issue 19), on a real PostgreSQL with real
server processes: the leader stops itself (SIGSTOP, frozen_server.py's store hook) inside the
transaction of a `ctl apply` it is answering, holding that transaction open as a frozen VM
would. Within the lease plus 2 s the standby leads (a takeover waits on nothing the old
leader holds, and ends its session); woken, the old leader's write is refused and rolled
back, and the request it had taken is answered NotLeader within a second instead of the
client's timeout. Then the same with the leader's TCP connection to the database left
open but silent (the partition relay): the old leader, woken while still cut off, still
answers its pending request at once and steps down.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio

from fakes.ha import HACluster
from fakes.live import wait_for
from fakes.postgres import PgServer
from fakes.tcpproxy import TcpProxy
from llmgw.model.deployment import Deployment
from llmgw.transport.client import request
from llmgw.transport.follow import NotLeaderError
from llmgw.transport.requests import ApplyOp

pytestmark = [pytest.mark.slow, pytest.mark.failover]

LEASE = 3.0


def stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


class Apply(threading.Thread):
    """One apply straight to one server, as ctl sends it, from a thread of this process:
    what came back (or the error) and when."""

    def __init__(self, c: HACluster, address: str, name: str) -> None:
        super().__init__(daemon=True)
        self.c, self.address, self.name = c, address, name
        self.outcome: Any = None
        self.at = 0.0

    def run(self) -> None:
        op = ApplyOp(Deployment(name=self.name, model=f"org/{self.name}", engine="simulated",
                                gpus_per_node=1, replicas=1))
        try:
            self.outcome = trio.run(request, self.address, self.c.admin_key, self.c.server_key, op, 30.0)
        except Exception as exc:  # looked at by the test
            self.outcome = exc
        self.at = time.monotonic()


def stored_deployments(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        return {r[0] for r in conn.execute("SELECT name FROM deployments").fetchall()}


@pytest.fixture
def cluster(tmp_path: Path, pg_url: str) -> Iterator[HACluster]:
    c = HACluster(tmp_path, pg_url, lease=f"{LEASE:g}s")
    try:
        yield c
    finally:
        for p in c.servers.values():  # a stopped process cannot take its SIGTERM
            if p.p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        c.close()


def freeze_during_apply(c: HACluster, freeze: Path, name: str) -> tuple[Apply, float, float]:
    """Arm the hook, send an apply to the leader (server 0), wait for it to stop inside the
    transaction, then for the standby to lead: (the apply, frozen at, took)."""
    freeze.write_text("INSERT INTO deployments")
    apply = Apply(c, c.addresses[0], name)
    apply.start()
    pid = c.servers[0].pid
    wait_for(lambda: stopped(pid), 15, "the leader stopping inside its write")
    frozen = time.monotonic()
    wait_for(lambda: c.leads(1) is not None, LEASE + 10, "the standby leading", interval=0.05)
    took = time.monotonic() - frozen
    print(f"frozen leader: the standby led {took:.2f}s after the leader froze inside a write "
          f"(lease {LEASE:g}s)")
    assert stopped(pid), "the old leader must still be frozen while the standby takes over"
    return apply, frozen, took


def test_leader_frozen_inside_a_write(cluster: HACluster, tmp_path: Path, pg_url: str) -> None:
    c = cluster
    freeze = tmp_path / "freeze"
    c.start_server(0, freeze=freeze)
    assert c.wait_leader() == 0
    c.start_server(1)
    apply, _frozen, took = freeze_during_apply(c, freeze, "frozen-write")
    assert took < LEASE + 2, f"the standby led {took:.1f}s after the leader froze"
    # Its session is gone before the takeover: ended by its own idle-in-transaction timeout
    # (half the lease), or by the standby taking over (PgLease.end_term).
    os.kill(c.servers[0].pid, signal.SIGCONT)
    woke = time.monotonic()
    apply.join(30)
    assert isinstance(apply.outcome, NotLeaderError), apply.outcome
    assert apply.at - woke < 1.0, f"the pending request was answered {apply.at - woke:.2f}s after waking"
    old = c.servers[0]
    wait_for(lambda: "stepped down from epoch" in old.text(), 10, "the old leader stepping down")
    assert "write refused" in old.text() and "another server took over" in old.text()
    assert "frozen-write" not in stored_deployments(pg_url)  # rolled back
    wait_for(lambda: old.text().count("standby on") >= 2, 10, "the old leader a standby again")
    assert f"the leader is {c.addresses[0]}" not in old.text()  # never names itself
    assert c.leads(0) is None and c.leads(1) is not None


def test_leader_frozen_inside_a_write_behind_a_silent_network(
        tmp_path: Path, pg_server: PgServer, pg_url: str) -> None:
    proxy = TcpProxy(("127.0.0.1", pg_server.port))
    c = HACluster(tmp_path, pg_url, lease=f"{LEASE:g}s")
    try:
        toml = c.tomls[0]  # server 0 reaches the database through the relay
        toml.write_text(toml.read_text().replace(f"127.0.0.1:{pg_server.port}/", f"127.0.0.1:{proxy.port}/"))
        freeze = tmp_path / "freeze"
        c.start_server(0, freeze=freeze)
        assert c.wait_leader() == 0
        c.start_server(1)
        freeze.write_text("INSERT INTO deployments")
        apply = Apply(c, c.addresses[0], "cut-off-write")
        apply.start()
        pid = c.servers[0].pid
        wait_for(lambda: stopped(pid), 15, "the leader stopping inside its write")
        proxy.drop.set()  # its connection to the database: open, and silent from now on
        frozen = time.monotonic()
        wait_for(lambda: c.leads(1) is not None, LEASE + 10, "the standby leading", interval=0.05)
        took = time.monotonic() - frozen
        print(f"frozen and cut off: the standby led {took:.2f}s after the freeze (lease {LEASE:g}s)")
        assert took < LEASE + 2, f"the standby led {took:.1f}s after the leader froze"
        os.kill(pid, signal.SIGCONT)  # woken, still cut off
        woke = time.monotonic()
        apply.join(30)
        assert isinstance(apply.outcome, NotLeaderError), apply.outcome
        assert apply.at - woke < 1.0, f"the pending request was answered {apply.at - woke:.2f}s after waking"
        old = c.servers[0]
        wait_for(lambda: "stepped down from epoch" in old.text(), 15, "the old leader stepping down")
        assert "Trio nursery" not in old.text()
        assert "cut-off-write" not in stored_deployments(pg_url)
        proxy.drop.clear()
        time.sleep(LEASE)
        assert c.leads(0) is None and c.leads(1) is not None
        assert "cut-off-write" not in stored_deployments(pg_url)
    finally:
        for p in c.servers.values():
            if p.p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        c.close()
        proxy.close()

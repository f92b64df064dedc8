"""Failover against a real PostgreSQL with real processes (issue 14): two servers on one
database, agents and ctl that know both, simulated engines.

- the leader SIGKILLed: the standby leads within the lease plus a few seconds, agents
  reconnect, no engine restarts, nothing ctl was told succeeded is lost, and the old
  leader, restarted, is a standby;
- the database restarted under a running leader, down longer than the lease: the leader
  steps down, a leader is elected again from the database's state, no engine restarts;
- the leader paused (SIGSTOP) past its lease: the standby takes over; woken, the old one
  steps down and its writes are refused by the epoch check;
- the network between the leader and the database lost: the leader stops acting before
  its lease can pass to the standby.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fakes.ha import HACluster
from fakes.live import engine_pids, wait_for
from fakes.nvidia_smi import pcie_box
from fakes.postgres import PgServer
from fakes.tcpproxy import TcpProxy

# Its own tier (about 1.5 min): `pytest -m failover`, a step of .ci/run of its own.
pytestmark = [pytest.mark.slow, pytest.mark.failover]

LEASE = 3.0


class Rig:
    def __init__(self, root: Path, pg_url: str) -> None:
        self.root = root
        self.c = HACluster(root, pg_url, lease=f"{LEASE:g}s", extra_server='restart_grace = "20s"\n')
        self.smi = pcie_box(root / "smi")

    def start_agents(self, *names: str) -> None:
        for name in names:
            self.c.start_agent(name, discovery={"nvidia_smi": str(self.smi)})

    def apply(self, name: str, replicas: int) -> None:
        f = self.root / f"{name}.yaml"
        f.write_text(f"name: {name}\nmodel: org/{name}\nengine: simulated\ngpus_per_node: 1\n"
                     f"replicas: {replicas}\nstrategy: spread\n")
        r = self.c.ctl("apply", "-f", str(f))
        assert r.returncode == 0, r.stderr

    def get(self, what: str) -> list[dict[str, Any]]:
        r = self.c.ctl("get", what, "-o", "json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)  # type: ignore[no-any-return]

    def ready(self) -> dict[str, int]:
        """Ready replica -> its generation."""
        return {x["id"]: x["generation"] for x in self.get("replicas") if x["state"] == "ready"}

    def up(self, agents: tuple[str, ...] = ("a1", "a2"), replicas: int = 2) -> int:
        self.c.start_server(0)
        first = self.c.wait_leader()
        self.c.start_server(1)
        self.start_agents(*agents)
        self.c.wait_states({a: "ready" for a in agents}, timeout=30)
        self.apply("m", replicas)
        wait_for(lambda: len(self.ready()) == replicas, 40, f"{replicas} replicas ready")
        return first


@pytest.fixture
def rig(tmp_path: Path, pg_url: str) -> Iterator[Rig]:
    r = Rig(tmp_path, pg_url)
    try:
        yield r
    finally:
        r.c.close()


def test_leader_sigkill(rig: Rig, tmp_path: Path) -> None:
    c = rig.c
    old = rig.up()
    engines, gens = engine_pids(tmp_path), rig.ready()
    rig.apply("late", 1)  # told it succeeded just before the leader dies
    c.servers[old].stop(signal.SIGKILL)
    killed = time.monotonic()
    new = c.wait_leader(timeout=LEASE + 10, not_=old)
    took = time.monotonic() - killed
    print(f"failover: the standby led {took:.2f}s after the SIGKILL (lease {LEASE:g}s)")
    assert took < LEASE + 3, f"the standby led {took:.1f}s after the kill"
    c.wait_states({"a1": "ready", "a2": "ready"}, timeout=20)
    assert "late" in {d["name"] for d in rig.get("deployments")}
    wait_for(lambda: len(rig.ready()) == 3, 30, "every replica ready on the new leader")
    now = rig.ready()
    assert {k: now[k] for k in gens} == gens  # same generations: nothing was replaced
    assert set(engines) <= set(engine_pids(tmp_path))  # zero engine restarts
    # The old leader comes back a standby, and ctl still finds the leader.
    back = c.start_server(old)
    time.sleep(LEASE)
    assert c.leads(old) is None and c.leader() == new
    assert "standby on" in back.text()
    assert rig.ready() == now


def test_database_restart_under_the_leader(rig: Rig, tmp_path: Path, pg_server: PgServer) -> None:
    c = rig.c
    leader = rig.up()
    engines, gens = engine_pids(tmp_path), rig.ready()
    pg_server.restart(down_for=LEASE * 1.5)
    # Down longer than the lease: the leader cannot renew and steps down...
    wait_for(lambda: "stepped down" in c.servers[leader].text(), LEASE + 5, "the leader stepping down")
    # ...and once the database is back, a leader is elected from the stored state.
    c.wait_leader(timeout=LEASE + 15)
    c.wait_states({"a1": "ready", "a2": "ready"}, timeout=30)
    rig.apply("after", 1)
    wait_for(lambda: len(rig.ready()) == 3, 30, "replicas ready after the database restart")
    now = rig.ready()
    assert {k: now[k] for k in gens} == gens
    assert set(engines) <= set(engine_pids(tmp_path))


def test_paused_leader_is_fenced(rig: Rig, tmp_path: Path) -> None:
    c = rig.c
    old = rig.up()
    engines, gens = engine_pids(tmp_path), rig.ready()
    pid = c.servers[old].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        new = _wait_other(c, old)
        rig.apply("while-paused", 1)  # to the new leader
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: "stepped down from epoch" in c.servers[old].text(), 10, "the old leader stepping down")
    assert c.leads(new) is not None
    wait_for(lambda: len(rig.ready()) == 3, 30, "replicas ready under the new leader")
    assert "while-paused" in {d["name"] for d in rig.get("deployments")}
    now = rig.ready()
    assert {k: now[k] for k in gens} == gens
    assert set(engines) <= set(engine_pids(tmp_path))


def _wait_other(c: HACluster, old: int) -> int:
    """A paused server's log still says it leads: the other one's log is what counts."""
    other = 1 - old
    return int(wait_for(lambda: c.leads(other) is not None and [other], LEASE + 10, "the standby leading")[0])


def test_leader_cut_off_from_the_database_stops_before_its_lease_passes(
        tmp_path: Path, pg_server: PgServer, pg_url: str) -> None:
    """The network between the leader and PostgreSQL loses every packet (a relay that
    swallows bytes and keeps the connections open, so nothing on the leader's side errors
    out): the leader must stop acting on its own clock, before the standby can win the
    lease, and the standby then leads with the agents and engines as they were."""
    proxy = TcpProxy(("127.0.0.1", pg_server.port))
    rig = Rig(tmp_path, pg_url)
    c = rig.c
    try:
        # Server 0 reaches the database through the relay, server 1 directly.
        toml = c.tomls[0]
        toml.write_text(toml.read_text().replace(f"127.0.0.1:{pg_server.port}/", f"127.0.0.1:{proxy.port}/"))
        assert rig.up() == 0
        engines, gens = engine_pids(tmp_path), rig.ready()
        proxy.drop.set()
        cut = time.monotonic()
        order: list[str] = []

        def standby_leads() -> bool:
            if not order and "stepped down from epoch" in c.servers[0].text():
                order.append("old leader stepped down")
            if c.leads(1) is not None:
                order.append("standby leads")
                return True
            return False

        wait_for(standby_leads, LEASE + 15, "the standby leading", interval=0.02)
        print(f"cut off: the standby led {time.monotonic() - cut:.2f}s after the cut (lease {LEASE:g}s)")
        assert order == ["old leader stepped down", "standby leads"], (order, c.servers[0].text()[-3000:])
        c.wait_states({"a1": "ready", "a2": "ready"}, timeout=30)
        rig.apply("after-cut", 1)
        wait_for(lambda: len(rig.ready()) == 3, 30, "replicas ready under the new leader")
        now = rig.ready()
        assert {k: now[k] for k in gens} == gens
        assert set(engines) <= set(engine_pids(tmp_path))
        assert c.leads(0) is None  # still cut off: it must not lead again
    finally:
        c.close()
        proxy.close()

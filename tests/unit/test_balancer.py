"""The balancer and the endpoint table: pure, time passed in."""

from __future__ import annotations

import random
from collections import Counter

from llmgw.router.routing.balancer import VNODES, Pool, Replica, prefix_key
from llmgw.router.routing.table import EndpointTable


def replicas(n: int, now: float = 0.0) -> list[Replica]:
    out = []
    for i in range(n):
        r = Replica(f"r{i}", f"http://127.0.0.1:{9000 + i}")
        r.set_load(0, 0, 0.1, now)
        out.append(r)
    return out


def test_replica_parses_url() -> None:
    r = Replica("a", "http://10.0.0.5:8000")
    assert (r.host, r.port, r.authority) == ("10.0.0.5", 8000, b"10.0.0.5:8000")
    r6 = Replica("b", "http://[::1]:81")
    assert (r6.host, r6.port) == ("::1", 81)


def test_least_outstanding_power_of_two() -> None:
    rs = replicas(2)
    pool = Pool(rs, rng=random.Random(1))
    rs[0].outstanding = 5
    assert all(pool.choose(0.0, 2.0) is rs[1] for _ in range(20))


def test_counts_at_dispatch_spread_load() -> None:
    rs = replicas(4)
    pool = Pool(rs, rng=random.Random(2))
    for _ in range(400):
        pool.choose(0.0, 2.0).outstanding += 1  # type: ignore[union-attr]
    counts = [r.outstanding for r in rs]
    assert max(counts) - min(counts) <= 3, counts


def test_stale_metrics_fall_back_to_the_in_flight_count() -> None:
    """An engine whose /metrics stalls under load is busy, not full (issue 11)."""
    rs = replicas(2, now=0.0)
    rs[1].set_load(0, 4, 0.1, 10.0)  # fresh at t=10, four waiting; r0's figures are 10 s old
    pool = Pool(rs, rng=random.Random(3))
    assert rs[0].score(10.0, 2.0) == 0.0
    assert all(pool.choose(10.0, 2.0) is rs[0] for _ in range(20))
    rs[0].outstanding = 6  # the router's own count says r0 is busier
    assert all(pool.choose(10.0, 2.0) is rs[1] for _ in range(20))
    rs[0].outstanding = 0
    # engine queue counts too
    rs[0].set_load(0, 0, 0.1, 10.0)
    rs[1].waiting = 10
    assert all(pool.choose(10.0, 2.0) is rs[0] for _ in range(20))


def test_ejection_with_cool_off_and_panic_mode() -> None:
    rs = replicas(2)
    pool = Pool(rs, rng=random.Random(4))
    rs[0].ejected_until = 10.0
    assert all(pool.choose(5.0, 100.0) is rs[1] for _ in range(10))
    assert {pool.choose(11.0, 100.0) for _ in range(50)} == set(rs)
    rs[1].ejected_until = 10.0
    assert pool.choose(5.0, 100.0) in rs  # all ejected: try anyway
    assert pool.choose(5.0, 100.0, exclude=tuple(rs)) is None
    rs[0].ready = rs[1].ready = False
    assert pool.choose(50.0, 100.0) is None


def test_prefix_affinity_sticks_and_is_bounded() -> None:
    rs = replicas(4)
    pool = Pool(rs, affinity=True, prefix_chars=16, rng=random.Random(5))
    first = pool.choose(0.0, 2.0, key="system prompt A")
    assert all(pool.choose(0.0, 2.0, key="system prompt A") is first for _ in range(10))
    keys = [f"prefix-{i}" for i in range(200)]
    owners = Counter(pool.choose(0.0, 2.0, key=k).replica_id for k in keys)  # type: ignore[union-attr]
    assert len(owners) == 4
    # Bounded load: one hot prefix does not pile onto its owner.
    for _ in range(100):
        pool.choose(0.0, 2.0, key="hot").outstanding += 1  # type: ignore[union-attr]
    assert max(r.outstanding for r in rs) <= 1.25 * 100 / 4 + 1
    # Memory is the ring only.
    assert len(pool._ring_keys) == 4 * VNODES


def test_prefix_key() -> None:
    assert prefix_key({"prompt": "abcdef"}, 3) == "abc"
    chat = {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "u"}]}
    assert prefix_key(chat, 100) == "sys\x00u"
    assert prefix_key({}, 10) is None


def test_table_keeps_state_across_snapshots() -> None:
    t = EndpointTable({"m": (True, 64)})
    snap = {
        "version": 1,
        "models": {
            "m": [
                {"replica_id": "a", "url": "http://h:1", "ready": True},
                {"replica_id": "b", "url": "http://h:2", "ready": False},
            ]
        },
    }
    assert t.apply(snap)
    a = t.replicas["a"]
    a.outstanding = 3
    a.ejected_until = 9.0
    assert not t.apply(snap)  # same version: nothing changes
    snap2 = {
        "version": 2,
        "models": {
            "m": [
                {"replica_id": "a", "url": "http://h:11", "ready": True},
                {"replica_id": "c", "url": "http://h:3", "ready": True},
            ],
            "n": [],
        },
    }
    assert t.apply(snap2)
    assert t.replicas["a"] is a and a.outstanding == 3 and a.ejected_until == 9.0
    assert a.port == 11
    assert set(t.replicas) == {"a", "c"}
    assert t.pools["m"].affinity and t.pools["m"].prefix_chars == 64
    assert t.ready_models() == ["m"]

"""Leases (server/tenants/leases.py, router/tenants/wallet.py), pure (issue 24): however routers ask, spend,
refund and give back, the units used in any sliding window never exceed the limit, summed
over routers; and a lone busy router gets the whole limit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.model.leases import Grant
from llmgw.router.tenants.wallet import Wallet
from llmgw.server.tenants.leases import LeaseBook

WINDOW = 60.0
TTL = 10.0

# One step: (seconds later, router index, units a request wants, units it really uses of
# those (a token estimate settled lower), lease size asked for when short).
steps_st = st.lists(st.tuples(st.floats(0, 8, allow_nan=False), st.integers(0, 2), st.integers(1, 5),
                              st.integers(0, 5), st.integers(1, 12)), max_size=250)


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(0, 30), steps=steps_st)
def test_no_sliding_window_exceeds_the_limit(limit: int, steps: list[tuple[float, int, int, int, int]]) -> None:
    book = LeaseBook(limit, WINDOW, TTL)
    wallets = [Wallet() for _ in range(3)]
    used: list[tuple[float, int]] = []
    now = 0.0
    for dt, r, want, real, ask in steps:
        now += dt
        for w in wallets:
            for gid, unused in w.expired(now):
                book.give_back(gid, unused, now)
        w = wallets[r]
        if w.available(now) < want:
            g = book.grant(f"r{r}", max(ask, want), now)
            if g is not None:
                assert g.units >= 1 and g.router == f"r{r}"
                w.add(g)
        if w.spend(want, now):
            actual = min(real, want)
            used.append((now, actual))
            w.refund(want - actual, now)
        assert book.occupied(now) <= limit
    for start, _ in used:  # every window that starts at a use: the worst ones
        total = sum(n for t, n in used if start <= t < start + WINDOW)
        assert total <= limit, (start, total, limit)


def test_a_lone_router_gets_the_whole_limit_then_waits_for_the_window() -> None:
    book, w = LeaseBook(10, WINDOW, TTL), Wallet()
    g = book.grant("a", 4, 0.0)
    assert g is not None and g.units == 4
    w.add(g)
    assert all(w.spend(1, 1.0) for _ in range(4)) and not w.spend(1, 1.0)
    g2 = book.grant("a", 100, 2.0)
    assert g2 is not None and g2.units == 6  # the rest of the limit, no more
    assert book.grant("b", 1, 3.0) is None
    # The first grant's units occupy until its end plus the window.
    assert book.retry_after(3.0) == pytest.approx(0.0 + TTL + WINDOW - 3.0)
    w.add(g2)
    assert w.spend(2, 3.0)
    for gid, unused in w.expired(12.5):  # g2 ended at 12: four units unused go back at once
        book.give_back(gid, unused, 12.5)
    assert book.occupied(12.5) == 6
    g3 = book.grant("b", 10, 12.5)
    assert g3 is not None and g3.units == 4
    # g1's four end at 70, g2's two used ones at 72, g3's four at 82.5.
    assert book.occupied(70.0) == 6 and book.occupied(72.0) == 4
    assert book.occupied(83.0) == 0 and book.retry_after(83.0) == 0.0


def test_bad_books_and_clamped_give_backs() -> None:
    with pytest.raises(ValueError):
        LeaseBook(1, 0.0, 1.0)
    book = LeaseBook(3, WINDOW, TTL)
    g = book.grant("a", 3, 0.0)
    assert g is not None
    book.give_back(g.id, 99, 1.0)  # more than granted: all of it, no more
    book.give_back(12345, 1, 1.0)  # unknown: nothing
    assert book.occupied(1.0) == 0 and book.grant("a", 9, 1.0) is not None


def test_a_router_cannot_give_back_another_routers_lease() -> None:
    book = LeaseBook(10, WINDOW, TTL)
    g = book.grant("r1", 10, 0.0)
    assert g is not None
    book.give_back(g.id, 10, 1.0, router="r2")
    assert book.occupied(1.0) == 10
    book.give_back(g.id, 4, 1.0, router="r1")
    assert book.occupied(1.0) == 6


def test_a_refund_spread_over_leases_is_not_lost() -> None:
    w = Wallet()
    w.add(Grant(1, "r", 300, 0.0, 10.0))
    w.add(Grant(2, "r", 300, 0.0, 10.0))
    assert w.spend(300, 1.0) and w.spend(260, 1.0)  # 300 of the first, 260 of the second
    w.refund(520, 1.0)  # the answers used 40 in all
    assert w.available(1.0) == 560

"""Concurrency slots (issue 24), pure: the server's SlotBook and a router's SlotWallet.
However three routers ask, start and end requests, renew, give back, die and meet a new
leader's term, never more than the key's concurrency run at once on slots, summed over
routers (server/tenants/slots.py has the argument)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.router.tenants.slots import SlotLease, SlotWallet
from llmgw.server.tenants.slots import RETRY, SlotBook

TTL = 10.0
HOLD = 2.5


def test_the_book_grants_free_slots_only() -> None:
    b = SlotBook(3, TTL, "a")
    assert b.grant("r1", 2, 0.0) == (1, 2)
    assert b.grant("r2", 5, 0.0) == (2, 1)  # fewer than asked: what is free
    assert b.grant("r3", 1, 0.0) is None and b.retry_after(0.0) == RETRY
    assert b.leased(0.0) == 3


def test_renewals_keep_give_back_and_extend() -> None:
    b = SlotBook(3, TTL, "a")
    assert b.grant("r1", 3, 0.0) == (1, 3)
    assert b.renew("r1", "a", 1, 2, 5.0) == 2  # one given back, the rest live until 15
    assert b.renew("r1", "a", 1, 3, 5.5) == 2  # a late or repeated renewal frees no more, adds none
    assert b.grant("r2", 5, 6.0) == (2, 1)
    assert b.renew("r2", "a", 1, 2, 6.0) == 0  # another router's grant: not renewed by r2
    assert b.leased(14.9) == 3 and b.leased(15.5) == 1  # r1's lapsed (not renewed since 5.5)
    assert b.renew("r1", "a", 1, 2, 15.5) == 0  # gone: this term never makes it again
    assert b.renew("r2", "a", 2, 0, 15.5) == 0  # all given back
    assert b.leased(15.5) == 0


def test_a_dead_routers_slots_are_free_after_a_ttl() -> None:
    b = SlotBook(2, TTL, "a")
    assert b.grant("dead", 2, 0.0) == (1, 2)
    assert b.grant("r2", 1, 9.9) is None
    assert b.grant("r2", 1, TTL) == (2, 1)


def test_a_new_term_holds_and_adopts_renewals_of_others() -> None:
    b = SlotBook(4, TTL, "b", hold_until=HOLD)
    assert b.renew("r1", "a", 7, 3, 0.5) == 3  # the old term's grant: adopted
    assert b.grant("r2", 4, 1.0) is None and b.retry_after(1.0) == HOLD - 1.0
    assert b.grant("r2", 4, HOLD) == (1, 1)  # only what is free beside the adopted
    assert b.renew("r1", "a", 7, 2, 3.0) == 2  # renewed and lowered like one of its own
    assert b.renew("r1", "a", 8, 9, 3.0) == 2  # clamped: a router adopts at most the limit
    assert b.renew("r1", "a", 9, 1, 3.0) == 0
    assert b.adopted == 3 + 2


def test_the_wallet_gives_back_what_the_last_second_did_not_use() -> None:
    w = SlotWallet()
    w.add(SlotLease("a", 1, 2, TTL))
    w.add(SlotLease("a", 2, 2, TTL))
    assert w.start(0.0) and w.start(0.0) and w.start(0.0)
    w.ended()
    w.ended()
    assert w.held(0.5) == 4 and w.running == 1
    out = w.renewals(1.0)  # the peak was 3: one slot back, from the newest grant
    assert [(s.id, keep) for s, keep in out] == [(1, 2), (2, 1)]
    for s, keep in out:
        w.renewed(s, keep, 1.0, TTL)
    assert w.held(1.0) == 3
    out = w.renewals(2.0)  # the peak since was 1
    assert [(s.id, keep) for s, keep in out] == [(1, 1), (2, 0)]  # grant 2 given back whole
    assert w.held(2.0) == 1
    w.renewed(out[0][0], 0, 2.0, TTL)  # the server has none of it: dropped
    assert w.held(2.0) == 0 and not w.start(2.0)
    w.ended()
    w.add(SlotLease("a", 3, 1, 5.0))
    assert w.start(4.0) and not w.start(4.0)
    w.ended()
    assert w.held(5.0) == 0  # lapsed: not renewed in time


# ---- the property ----------------------------------------------------------------------

# One step: (seconds later (< a ttl), router, action, argument).
ACTIONS = ("start", "end", "tick", "skip", "die", "failover")
steps_st = st.lists(st.tuples(st.floats(0, 3, allow_nan=False), st.integers(0, 2),
                              st.sampled_from(ACTIONS), st.integers(1, 4)), max_size=300)


@settings(max_examples=1000, deadline=None)
@given(limit=st.integers(0, 6), steps=steps_st)
def test_never_more_than_the_concurrency_at_once(limit: int, steps: list[tuple[float, int, str, int]]) -> None:
    term = 0
    book = SlotBook(limit, TTL, str(term))
    wallets = [SlotWallet() for _ in range(3)]
    # Seconds since each router last reached the server: a live router renews within a
    # ttl (the bound beyond that is stated in slots.py, not claimed here).
    silent = [0.0, 0.0, 0.0]
    now = 0.0

    def tick(i: int) -> None:
        for lease, keep in wallets[i].renewals(now):
            wallets[i].renewed(lease, book.renew(f"r{i}", lease.term, lease.id, keep, now), now, TTL)
        silent[i] = 0.0

    pending: dict[int, float] = {}  # routers yet to reach a new term: by when they do

    for dt, r, action, n in steps:
        target = now + dt
        for i, at in sorted(pending.items(), key=lambda p: p[1]):
            if at <= target:  # it reaches the new leader, within the hold
                now = max(now, at)
                del pending[i]
                tick(i)
        now = target
        for i in range(3):
            silent[i] += dt
            if silent[i] >= TTL - 3 and i not in pending:  # late next step: it renews now
                tick(i)
        w = wallets[r]
        if action == "start":
            if r in pending:  # its ask is answered `declare`: it renews first
                del pending[r]
                tick(r)
            for _ in range(n):
                if not w.start(now):
                    got = book.grant(f"r{r}", n, now)
                    if got is not None:
                        w.add(SlotLease(str(term), got[0], got[1], now + TTL))
                    w.start(now)
        elif action == "end":
            for _ in range(min(n, w.running)):
                w.ended()
        elif action == "tick":
            pending.pop(r, None)
            tick(r)
        elif action == "die":  # its requests die with it; its slots lapse in the book
            wallets[r] = SlotWallet()
        elif action == "failover":
            # A new term's book knows nothing; every router reaches it within the hold,
            # in any order, while others ask.
            term += 1
            book = SlotBook(limit, TTL, str(term), hold_until=now + HOLD)
            for i in range(3):
                pending[i] = now + HOLD * ((i + n) % 4) / 4
        running = sum(x.running for x in wallets)
        assert running <= limit, (running, limit, action)
        assert all(x.running <= x.held(now) for x in wallets)


def test_without_adoption_a_new_term_would_lease_the_slots_again() -> None:
    """What the hold and the adoption are for."""
    old = SlotBook(2, TTL, "a")
    w1 = SlotWallet()
    got = old.grant("r1", 2, 0.0)
    assert got is not None
    w1.add(SlotLease("a", got[0], got[1], TTL))
    assert w1.start(0.0) and w1.start(0.0)
    blind = SlotBook(2, TTL, "b")
    assert blind.grant("r2", 2, 1.0) == (1, 2)  # 4 would run at once
    new = SlotBook(2, TTL, "b", hold_until=1.0 + HOLD)
    for lease, keep in w1.renewals(1.0):
        assert new.renew("r1", lease.term, lease.id, keep, 1.0) == 2
    assert new.grant("r2", 2, 1.0 + HOLD) is None

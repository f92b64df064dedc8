"""The fair queue (router/routing/fairqueue.py): bands, round-robin across keys, ttl,
the bound and cancel, as tables and as hypothesis properties over any sequence of
pushes, pops, cancels and passing time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.router.routing.fairqueue import Band, Entry, FairQueue, Shed, effective_band

HI = Band("interactive", 10, 5.0)
LO = Band("batch", 0, 60.0)
MID = Band("standard", 5, 20.0)


def served(q: FairQueue[str]) -> list[str]:
    out = []
    while (e := q.pop()) is not None:
        out.append(e.item)
    return out


def test_highest_band_first_then_round_robin_across_keys() -> None:
    q: FairQueue[str] = FairQueue([LO, HI], 100)
    for i in range(4):
        q.push(f"flood{i}", LO, "flood", 0.0)
    q.push("b0", LO, "b", 1.0)
    q.push("c0", LO, "c", 2.0)
    q.push("c1", LO, "c", 2.0)
    q.push("i0", HI, "i", 3.0)
    assert served(q) == ["i0", "flood0", "b0", "c0", "flood1", "c1", "flood2", "flood3"]


@pytest.mark.parametrize(("key_class", "asked", "got"), [
    (HI, None, HI), (HI, LO, LO), (HI, HI, HI), (LO, HI, LO), (LO, None, LO), (MID, LO, LO),
    (MID, HI, MID),
])
def test_a_request_may_lower_its_class_never_raise_it(key_class: Band, asked: Band | None,
                                                      got: Band) -> None:
    assert effective_band(key_class, asked) == got


def test_ttl_per_band_sheds_with_its_reason() -> None:
    q: FairQueue[str] = FairQueue([LO, HI], 100)
    q.push("i", HI, "k", 0.0)
    q.push("b", LO, "k", 0.0)
    assert q.next_deadline() == 5.0
    assert q.expire(4.9) == []
    [(e, why)] = q.expire(5.0)
    assert (e.item, why) == ("i", Shed("queue_timeout", "no engine slot within 5s", "interactive"))
    assert q.next_deadline() == 60.0 and len(q) == 1
    assert [e.item for e, _ in q.expire(60.0)] == ["b"] and q.next_deadline() is None


def test_full_queue_refuses_or_displaces_the_lower_bands_biggest_burst() -> None:
    q: FairQueue[str] = FairQueue([LO, HI], 3)
    q.push("a0", LO, "a", 0.0)
    q.push("a1", LO, "a", 0.0)
    q.push("b0", LO, "b", 0.0)
    assert q.push("b1", LO, "b", 0.0) == Shed("queue_full", "3 requests queued", "batch")
    e = q.push("i0", HI, "i", 0.0)
    assert isinstance(e, Entry) and len(q) == 3
    assert q.next_deadline() == float("-inf")  # the displaced one is to be answered now
    [(gone, why)] = q.expire(0.0)
    assert (gone.item, why.why, why.band) == ("a1", "displaced", "batch")
    q.push("i1", HI, "i", 0.0)  # displaces a0 (a and b tie at one each: the first found)
    q.push("i2", HI, "i", 0.0)
    assert isinstance(q.push("i3", HI, "i", 0.0), Shed)  # nothing lower left to displace
    assert len(q.expire(0.0)) == 2 and served(q) == ["i0", "i1", "i2"]


def test_cancel_takes_a_waiting_request_out_once() -> None:
    q: FairQueue[str] = FairQueue([HI], 10)
    a = q.push("a", HI, "k", 0.0)
    b = q.push("b", HI, "k2", 0.0)
    assert isinstance(a, Entry) and isinstance(b, Entry)
    assert q.cancel(a) and not q.cancel(a)
    assert list(q.keys("interactive")) == ["k2"] and q.waiting("interactive") == 1
    assert q.pop() is b and not q.cancel(b)
    assert q.expire(100.0) == [] and q.pop() is None


def test_vllm_priority_highest_band_is_vllms_default_zero() -> None:
    q: FairQueue[str] = FairQueue([LO, HI, MID], 10)
    assert [q.vllm_priority(b) for b in (HI, MID, LO)] == [0, 1, 2]


@pytest.mark.parametrize("bands", [[], [HI, Band("interactive", 1, 1.0)], [HI, Band("x", 10, 1.0)],
                                   [Band("x", 1, 0.0)]])
def test_bad_bands_are_refused(bands: list[Band]) -> None:
    with pytest.raises(ValueError):
        FairQueue(bands, 10)


def test_a_band_of_another_queue_is_refused() -> None:
    with pytest.raises(ValueError):
        FairQueue[str]([HI], 10).push("x", LO, "k", 0.0)


# --- properties -------------------------------------------------------------------------

BANDS = (HI, MID, LO)
KEYS = ("a", "b", "c", "d")
OPS = st.lists(st.one_of(
    st.tuples(st.just("push"), st.sampled_from(BANDS), st.sampled_from(KEYS)),
    st.tuples(st.just("pop")),
    st.tuples(st.just("cancel"), st.integers(0, 200)),
    st.tuples(st.just("tick"), st.floats(0.0, 30.0)),
), max_size=120)


class Run:
    """Drives a queue through ops, recording what each pushed item became."""

    def __init__(self, bands: tuple[Band, ...], size: int) -> None:
        self.q: FairQueue[int] = FairQueue(bands, size)
        self.now = 0.0
        self.n = 0
        self.entries: list[Entry[int]] = []
        self.fate: dict[int, list[str]] = {}
        self.pops: list[Entry[int]] = []

    def shed(self) -> None:
        for e, _ in self.q.expire(self.now):
            self.fate[e.item].append("shed")

    def step(self, op: tuple) -> Entry[int] | None:
        self.shed()
        if op[0] == "push":
            self.n += 1
            self.fate[self.n] = []
            got = self.q.push(self.n, op[1], op[2], self.now)
            if isinstance(got, Shed):
                self.fate[self.n].append("refused")
            else:
                self.entries.append(got)
        elif op[0] == "pop":
            e = self.q.pop()
            if e is not None:
                self.fate[e.item].append("served")
                self.pops.append(e)
            return e
        elif op[0] == "cancel" and self.entries:
            e = self.entries[op[1] % len(self.entries)]
            if self.q.cancel(e):
                self.fate[e.item].append("cancelled")
        elif op[0] == "tick":
            self.now += op[1]
        return None

    def live(self) -> list[Entry[int]]:
        return [e for e in self.entries if e.state == "waiting"]


@settings(max_examples=300)
@given(OPS, st.integers(0, 12))
def test_never_serves_a_lower_band_while_a_higher_one_waits(ops: list, size: int) -> None:
    r = Run(BANDS, size)
    for op in ops:
        if op[0] == "pop":
            r.q.expire(r.now)  # the caller's contract: shed before serving
            best = max((e.band.rank for e in r.live()), default=None)
            e = r.q.pop()
            assert (e.band.rank if e else None) == best


@settings(max_examples=300)
@given(OPS, st.integers(0, 12))
def test_no_key_served_twice_while_another_waiting_key_is_passed_over(ops: list, size: int) -> None:
    """Within a band: if key A is served at steps s1 < s2, every other key of the band that
    had a request waiting at every step from s1 to s2 was served in between."""
    r = Run(BANDS, size)
    since: dict[tuple[str, str], int] = {}  # (band, key) -> the step it began waiting
    last: dict[tuple[str, str], int] = {}  # (band, key) -> the step it was last served
    for step, op in enumerate(ops):
        r.shed()
        waiting = {(x.band.name, x.key) for x in r.live()}  # just before this step's pop
        e = r.step(op)
        if e is not None:
            a = (e.band.name, e.key)
            if a in last:
                s1 = last[a]
                for (band, key), began in since.items():
                    if (band, key) in waiting and band == e.band.name and key != e.key and began < s1:
                        assert last.get((band, key), -1) > s1, (key, "passed over by", e.key)
            last[a] = step
        waiting = {(x.band.name, x.key) for x in r.live()}
        since = {k: since.get(k, step) for k in waiting}


@settings(max_examples=300)
@given(OPS, st.integers(0, 12))
def test_every_item_comes_back_exactly_once(ops: list, size: int) -> None:
    r = Run(BANDS, size)
    for op in ops:
        r.shed()
        lower = any(e.band.rank < op[1].rank for e in r.live()) if op[0] == "push" else False
        full = len(r.q) >= size
        r.step(op)
        if op[0] == "push":  # refused only when full with nothing of a lower band to displace
            assert (r.fate[r.n] == ["refused"]) == (full and not lower)
        assert len(r.q) == len(r.live()) == sum(r.q.waiting(b.name) for b in BANDS) <= size
    for e, _ in r.q.expire(float("inf")):
        r.fate[e.item].append("shed")
    assert r.q.pop() is None and len(r.q) == 0 and r.q.next_deadline() is None
    assert {item: len(f) for item, f in r.fate.items()} == {item: 1 for item in r.fate}


@settings(max_examples=300)
@given(st.lists(st.one_of(st.tuples(st.just("push"), st.just(HI), st.just("k")),
                          st.tuples(st.just("pop")), st.tuples(st.just("cancel"), st.integers(0, 99)),
                          st.tuples(st.just("tick"), st.floats(0.0, 2.0))), max_size=120),
       st.integers(0, 12))
def test_one_band_one_key_is_first_come_first_served(ops: list, size: int) -> None:
    """Today's admission queue: served in the order pushed, refused when `size` wait,
    shed `ttl` after it came."""
    r = Run((HI,), size)
    for op in ops:
        if op[0] == "push":
            full = len(r.q) >= size
            r.step(op)
            assert (r.fate[r.n] == ["refused"]) == full
        else:
            r.step(op)
    items = [e.item for e in r.pops]
    assert items == sorted(items)
    for e in r.pops:
        assert e.since + HI.ttl > r.now or e.state == "served"

"""Concurrency exact across routers (issue 24): three routers' Limiters and the server's
LimitBooks over the codec, on trio's autojump clock. Slow requests through three routers
at concurrency=2 never run more than 2 at once in total, through a change of leader too;
a dead router's slots come back within a ttl; an idle router holds none; a router holding
slots admits with no round trip; a lost server and servers and routers from before slots."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest
import trio

from llmgw.errors import ProtocolError, RequestFailedError
from llmgw.model.apikey import ApiKeyRecord, hash_secret
from llmgw.router.errors import ApiError
from llmgw.router.tenants.limits import Charge, Limiter
from llmgw.server.peers.sessions import Peer
from llmgw.server.tenants.limits import SLOT_TTL, LimitBooks
from llmgw.transport.apikey_ops import MAX_HELD, MAX_LIMIT, LeaseOp, LeaseResult, LimitKind
from llmgw.transport.codec import converter, structure_result


def key(**kw: Any) -> ApiKeyRecord:
    return ApiKeyRecord("k", hash_secret("s"), "", **kw)


class Leaders:
    """One leader at a time; `fail` makes a new term (a new LimitBooks: empty books)."""

    def __init__(self, k: ApiKeyRecord, hold: float | None = None) -> None:
        self.keys = {k.name: k}
        self.hold = hold
        self.books = self._books()
        self.up = True
        self.asks = 0
        self.adopted = 0

    def _books(self) -> LimitBooks:
        return LimitBooks(lambda: self.keys) if self.hold is None \
            else LimitBooks(lambda: self.keys, hold=self.hold)

    def fail(self) -> None:
        self.adopted += sum(b.adopted for b in self.books.slots.values())
        self.books = self._books()

    def asker(self, router: str, before_slots: bool = False) -> Any:
        async def ask(op: LeaseOp) -> Any:
            self.asks += 1
            await trio.sleep(0.002)
            if not self.up:
                raise OSError("unreachable")
            if before_slots and op.kind is LimitKind.CONCURRENCY:  # refused on decode
                raise RequestFailedError("bad request message: kind: 'concurrency' is not a valid LimitKind")
            # Through the codec both ways, as on the wire.
            op = converter.structure(msgpack.unpackb(msgpack.packb(converter.unstructure(op))), LeaseOp)
            got = self.books.op_lease(Peer(b"", "router", router), op, trio.current_time())
            got = await got if hasattr(got, "__await__") else got
            return msgpack.unpackb(msgpack.packb(got))
        return ask


async def test_concurrency_holds_across_three_routers_and_a_failover(
        autojump_clock: trio.abc.Clock) -> None:
    k = key(concurrency=2, on_server_loss="deny")
    leaders = Leaders(k)
    routers = [Limiter(leaders.asker(f"r{i}")) for i in range(3)]
    rng = random.Random(24)
    running = 0
    most = 0
    served = 0
    codes: set[int] = set()

    async def client(lim: Limiter) -> None:
        nonlocal running, most, served
        while trio.current_time() < 150:
            try:
                c = await lim.admit(k, 0)
            except ApiError as e:
                codes.add(e.status)
                await trio.sleep(rng.uniform(0.05, 0.3))
                continue
            running += 1
            most = max(most, running)
            await trio.sleep(rng.uniform(0.5, 6.0))  # a slow request
            running -= 1
            served += 1
            lim.settle(c, 0)

    async def failover() -> None:
        await trio.sleep(40)  # routers hold slots, requests run on them
        leaders.up = False
        await trio.sleep(1)  # the election (under a ttl: no slot lapses)
        leaders.fail()
        leaders.up = True

    async with trio.open_nursery() as n:
        for lim in routers:
            n.start_soon(lim.keep_terms)
        n.start_soon(failover)
        for lim in routers:
            for _ in range(3):
                n.start_soon(client, lim)
        await trio.sleep(160)
        n.cancel_scope.cancel()
    print(f"at most {most} at once, {served} served")
    assert most <= 2, most
    assert most == 2 and served >= 60, served  # the limit used, after the failover too
    assert leaders.adopted + sum(b.adopted for b in leaders.books.slots.values()) >= 1
    assert codes <= {429, 503}


async def test_a_dead_routers_slots_come_back_within_a_ttl(autojump_clock: trio.abc.Clock) -> None:
    k = key(concurrency=2)
    leaders = Leaders(k, hold=0.0)
    dead, alive = Limiter(leaders.asker("dead")), Limiter(leaders.asker("alive"))
    async with trio.open_nursery() as n:
        n.start_soon(dead.keep_terms)
        await dead.admit(k, 0)
        await dead.admit(k, 0)  # never settled: it dies with them
        await trio.sleep(5)
        n.cancel_scope.cancel()  # the router is gone: no more renewals
    died = trio.current_time()
    with pytest.raises(ApiError) as full:
        await alive.admit(k, 0)
    assert full.value.status == 429 and full.value.headers() == b"retry-after: 1\r\n"
    while True:
        try:
            c = await alive.admit(k, 0)
        except ApiError:
            await trio.sleep(0.5)
        else:
            break
    back = trio.current_time() - died
    assert back <= SLOT_TTL + 1.0, back
    alive.settle(c, None)


async def test_an_idle_router_gives_its_slots_back(autojump_clock: trio.abc.Clock) -> None:
    k = key(concurrency=8)
    leaders = Leaders(k, hold=0.0)
    lim = Limiter(leaders.asker("r0"))
    async with trio.open_nursery() as n:
        n.start_soon(lim.keep_terms)
        charges = [await lim.admit(k, 0) for _ in range(5)]
        await trio.sleep(1.5)
        assert leaders.books.slots["k"].leased(trio.current_time()) == 5
        for c in charges[:4]:
            lim.settle(c, None)
        await trio.sleep(2.5)
        assert leaders.books.slots["k"].leased(trio.current_time()) == 1  # what runs
        lim.settle(charges[4], None)
        await trio.sleep(2.5)
        assert leaders.books.slots["k"].leased(trio.current_time()) == 0
        n.cancel_scope.cancel()


async def test_slots_held_cost_no_round_trip(autojump_clock: trio.abc.Clock) -> None:
    k = key(concurrency=4)
    leaders = Leaders(k, hold=0.0)
    lim = Limiter(leaders.asker("r0"))
    async with trio.open_nursery() as n:
        n.start_soon(lim.keep_terms)
        busy = await lim.admit(k, 0)  # keeps a slot in use: none is given back
        for _ in range(1000):
            c = await lim.admit(k, 0)
            await trio.sleep(0.001)
            lim.settle(c, None)
        n.cancel_scope.cancel()
    lim.settle(busy, None)
    assert leaders.asks <= 2 + 3  # two asks, a renewal a second


async def test_a_lost_server_admits_up_to_the_concurrency_alone_or_denies(
        autojump_clock: trio.abc.Clock) -> None:
    allow, deny = key(concurrency=2), ApiKeyRecord("d", hash_secret("t"), "", concurrency=2,
                                                   on_server_loss="deny")
    leaders = Leaders(allow, hold=0.0)
    leaders.keys["d"] = deny
    lim = Limiter(leaders.asker("r0"))
    held: list[Charge] = [await lim.admit(allow, 0), await lim.admit(deny, 0)]  # one slot each
    leaders.up = False
    held.append(await lim.admit(allow, 0))  # beyond the slot held: admitted, alone
    with pytest.raises(ApiError) as third:
        await lim.admit(allow, 0)
    assert third.value.status == 429 and "concurrent" in third.value.message
    assert lim.lost_admits == 1
    with pytest.raises(ApiError) as denied:
        await lim.admit(deny, 0)
    assert denied.value.status == 503 and denied.value.code == "limits_unavailable"
    lim.settle(held[1], None)
    held.append(await lim.admit(deny, 0))  # its slot held, still live: admitted


async def test_a_server_from_before_slots(autojump_clock: trio.abc.Clock) -> None:
    """It refuses the op's kind: the router counts alone, as before, and rates still lease."""
    k = key(concurrency=2, rpm=100)
    leaders = Leaders(k, hold=0.0)
    lim = Limiter(leaders.asker("r0", before_slots=True))
    a, b = await lim.admit(k, 0), await lim.admit(k, 0)
    with pytest.raises(ApiError) as third:
        await lim.admit(k, 0)
    assert third.value.status == 429
    assert lim.lost_admits == 0 and trio.current_time() >= lim.leases.lost_until  # not a lost server
    assert leaders.books.granted >= 1  # rpm leased as ever
    lim.settle(a, None)
    lim.settle(b, None)


def test_a_router_from_before_slots_is_answered_as_before() -> None:
    """Its ops never name the kind; the answers carry nothing it would refuse."""
    k = key(concurrency=2, rpm=10)
    books = LimitBooks(lambda: {"k": k}, hold=0.0)
    old = {"grant_id", "units", "ttl", "retry_after"}  # LeaseResult before terms
    got = books.op_lease(Peer(b"", "router", "r0"), LeaseOp("k", LimitKind.RPM, 1), 0.0)
    assert set(got) <= old
    assert not books.slots  # no slot book made for it


def test_a_renewals_answer_is_bounded_like_its_op() -> None:
    """`kept` comes from the server: at most MAX_HELD counts, each one within the limits'
    bounds; anything else is a ProtocolError, as a malformed declaration is."""
    ok = structure_result({"kept": [0, 3] * (MAX_HELD // 2), "ttl": 10.0}, LeaseResult)
    assert len(ok.kept) == MAX_HELD
    for bad in ([1] * (MAX_HELD + 1), [-1], [MAX_LIMIT + 1], ["3"], [True]):
        with pytest.raises(ProtocolError):
            structure_result({"kept": bad}, LeaseResult)

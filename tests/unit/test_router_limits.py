"""Per-key limits (issue 24): three routers' Limiters asking one server's LimitBooks for
leases, on trio's autojump clock: rpm exact across routers in every sliding minute, tpm
charged up front and settled, budgets, concurrency, a lost server (rates admit, budgets
refuse), and the 429 shapes."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from llmgw.model.apikey import ApiKeyRecord, Budget, hash_secret
from llmgw.router.errors import ApiError
from llmgw.router.tenants.limits import DEFAULT_MAX_TOKENS, Limiter, estimate
from llmgw.server.peers.sessions import Peer
from llmgw.server.tenants.limits import LimitBooks
from llmgw.transport.apikey_ops import LeaseOp, LimitKind


def key(**kw: Any) -> ApiKeyRecord:
    return ApiKeyRecord("k", hash_secret("s"), "", **kw)


class Server:
    def __init__(self, k: ApiKeyRecord, hold: float = 0.0) -> None:
        self.keys = {k.name: k}
        # No hold by default: these tests are of one term (test_limits_failover: of several).
        self.books = LimitBooks(lambda: self.keys, hold=hold)
        self.up = True
        self.asks = 0

    def asker(self, router: str) -> Any:
        async def ask(op: LeaseOp) -> Any:
            self.asks += 1
            await trio.sleep(0.002)  # a round trip
            if not self.up:
                raise OSError("unreachable")
            return self.books.op_lease(Peer(b"", "router", router), op, trio.current_time())
        return ask


async def test_rpm_holds_across_three_routers(autojump_clock: trio.abc.Clock) -> None:
    k = key(rpm=10)
    server = Server(k)
    routers = [Limiter(server.asker(f"r{i}")) for i in range(3)]
    accepted: list[float] = []
    refusals: list[ApiError] = []

    async def client(lim: Limiter, gap: float) -> None:
        while trio.current_time() < 150:
            try:
                c = await lim.admit(k, 0)
            except ApiError as e:
                refusals.append(e)
            else:
                accepted.append(trio.current_time())
                lim.settle(c, 0)
            await trio.sleep(gap)

    async with trio.open_nursery() as n:
        for i, lim in enumerate(routers):
            for j in range(3):
                n.start_soon(client, lim, 0.05 + 0.013 * (i * 3 + j))
    accepted.sort()
    worst = max(sum(1 for t in accepted if a <= t < a + 60) for a in accepted)
    assert worst <= 10
    assert len(accepted) >= 20  # the limit is used, not starved (150 s: two windows and more)
    e = refusals[0]
    assert e.status == 429 and e.code == "rate_limit_exceeded" and e.retry_after >= 1
    body = json.loads(e.body())
    assert body["error"]["type"] == "requests" and "requests per minute" in body["error"]["message"]
    # Refusals are kept a second: not one ask per refused request.
    assert server.asks < len(refusals) / 5


async def test_tpm_charged_up_front_and_settled(autojump_clock: trio.abc.Clock) -> None:
    k = key(tpm=1000)
    server = Server(k)
    lim = Limiter(server.asker("r0"))
    with pytest.raises(ApiError) as huge:
        await lim.admit(k, 5000)  # refused before anything is spent
    assert huge.value.status == 429 and "estimate" in huge.value.message
    used = 0

    async def until_refused(charge: int) -> int:
        nonlocal used
        n = 0
        while True:
            try:
                c = await lim.admit(k, charge)
            except ApiError as e:
                assert e.status == 429 and e.type == "tokens"
                return n
            lim.settle(c, 40)  # the answer used far fewer than its estimate
            used += 40
            n += 1
    first = await until_refused(300)
    assert first >= 10  # settled: far more than 1000 / 300 requests fit
    # What the answers did not use goes back to the server when the leases end (10 s),
    # long before the minute: more requests fit within the same minute.
    await trio.sleep(11)
    second = await until_refused(200)
    assert second >= 1
    assert used <= 1000


def test_estimate() -> None:
    assert estimate({"max_tokens": 10}, 400) == 110
    assert estimate({}, 4) == 1 + DEFAULT_MAX_TOKENS
    assert estimate({"max_tokens": True}, 0) == DEFAULT_MAX_TOKENS


async def test_budget_is_insufficient_quota_and_refused_when_the_server_is_lost(
        autojump_clock: trio.abc.Clock) -> None:
    k = key(budget=Budget(100, 3600.0), rpm=1000)
    server = Server(k)
    lim = Limiter(server.asker("r0"))
    c = await lim.admit(k, 60)
    lim.settle(c, 60)
    with pytest.raises(ApiError) as spent:
        for _ in range(5):
            lim.settle(await lim.admit(k, 30), 30)
    assert spent.value.status == 429 and spent.value.code == "insufficient_quota"
    assert json.loads(spent.value.body())["error"]["type"] == "insufficient_quota"
    # The server goes away: rate limits admit (beyond the lease held), budgets refuse.
    server.up = False
    await trio.sleep(20)  # leases held have ended
    rate_only = key(rpm=1)
    server.keys["k"] = rate_only
    for _ in range(3):
        await lim.admit(rate_only, 0)
    assert lim.lost_admits >= 2
    with pytest.raises(ApiError) as lost:
        await lim.admit(k, 10)
    assert lost.value.status == 503 and lost.value.code == "budget_unavailable"


async def test_concurrency(autojump_clock: trio.abc.Clock) -> None:
    k = key(concurrency=2)
    lim = Limiter(None)
    a, b = await lim.admit(k, 0), await lim.admit(k, 0)
    with pytest.raises(ApiError) as third:
        await lim.admit(k, 0)
    assert third.value.status == 429 and "concurrent" in third.value.message
    lim.settle(a, None)
    lim.settle(b, None)
    lim.settle(await lim.admit(k, 0), None)


async def test_on_server_loss_per_key(autojump_clock: trio.abc.Clock) -> None:
    deny = key(rpm=5, on_server_loss="deny")
    allow = key(budget=Budget(100, 3600.0), on_server_loss="allow")
    server = Server(deny)
    server.up = False
    lim = Limiter(server.asker("r0"))
    with pytest.raises(ApiError) as refused:
        await lim.admit(deny, 0)
    assert refused.value.status == 503 and refused.value.code == "limits_unavailable"
    lim.settle(await lim.admit(allow, 10), 10)  # a budget, but this key says allow
    assert lim.lost_admits == 1


async def test_the_fast_path_takes_all_of_a_request_or_nothing(autojump_clock: trio.abc.Clock) -> None:
    """admit_now (no await) admits on what the router holds; a request one wallet cannot
    cover takes nothing (the rpm unit and the slot it took go back) and is left to
    `admit`; a new record of the key (the table changed) is `admit`'s too, once."""
    k = key(rpm=1000, tpm=2000, concurrency=10)
    server = Server(k)
    lim = Limiter(server.asker("r0"))
    now = trio.current_time
    assert lim.admit_now(k, 10, now()) is None  # a key not seen yet: admit
    lim.settle(await lim.admit(k, 10), 10)  # leases: 50 requests and 100 tokens (a 20th)
    gate = lim.gates["k"]
    rpm, tpm = (gate.wallets[kind] for kind in (LimitKind.RPM, LimitKind.TPM))
    held = (rpm.available(now()), tpm.available(now()), gate.slots.running)
    c = lim.admit_now(k, 30, now())
    assert c is not None and server.asks == 3  # no ask: rpm, tpm and a slot were held
    assert (rpm.available(now()), tpm.available(now())) == (held[0] - 1, held[1] - 30)
    lim.settle(c, 5, now())  # 25 tokens back; the slot back
    assert (tpm.available(now()), gate.slots.running) == (held[1] - 5, 0)
    assert lim.admit_now(k, held[1], now()) is None  # tpm holds 5 fewer: nothing taken
    assert (rpm.available(now()), tpm.available(now()), gate.slots.running) == \
        (held[0] - 1, held[1] - 5, 0)
    assert lim.admit_now(k, 2001, now()) is None  # over the key's tpm: admit refuses it
    with pytest.raises(ApiError):
        await lim.admit(k, 2001)
    k2 = key(rpm=1000, tpm=2000, concurrency=10, models=("m",))  # the table changed
    assert lim.admit_now(k2, 1, now()) is None
    lim.settle(await lim.admit(k2, 1), 1)
    assert lim.admit_now(k2, 1, now()) is not None

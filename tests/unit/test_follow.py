"""Following the leader: which address next (pure), and a request that meets standbys."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from llmgw.errors import RequestFailedError, ServerUnreachableError
from llmgw.transport.follow import Follower, LeaderClient, NotLeaderError

A, B, C = "tcp://a:1", "tcp://b:1", "tcp://c:1"


def test_follower_goes_where_the_standby_points() -> None:
    f = Follower([A, B, C])
    assert f.pick() == A
    f.redirected(C)
    assert f.pick() == C
    f.connected()
    assert f.pick() == C  # it was up: the same address once more (a restart)
    assert f.pick() == A  # that did not come up: the next one
    f.redirected("tcp://elsewhere:1")  # not in our list: the next address, not a stranger
    assert f.pick() == B


def test_one_address_stays_put() -> None:
    f = Follower([A])
    for _ in range(3):
        assert f.pick() == A
    with pytest.raises(ValueError):
        Follower([])


async def test_leader_client_follows_hints(autojump_clock: trio.testing.MockClock) -> None:
    leader = [C]
    asked: list[tuple[str, float]] = []

    async def request(server: str, key: str, server_key: str, op: Any, timeout: float) -> Any:
        asked.append((server, timeout))
        if server == "tcp://down:1":
            await trio.sleep(timeout)
            raise ServerUnreachableError("no answer")
        if server != leader[0]:
            raise NotLeaderError(server, leader[0])
        return {"from": server}

    client = LeaderClient(["tcp://down:1", A, C], request)
    assert await client("k", "sk", "op", 6.0) == {"from": C}
    assert [s for s, _ in asked] == ["tcp://down:1", A, C]
    assert asked[0][1] == 2.0  # a dead address costs a share of the timeout, not all of it
    asked.clear()
    assert await client("k", "sk", "op", 6.0) == {"from": C}
    assert [s for s, _ in asked] == [C]  # remembered
    leader[0] = A  # failover
    assert await client("k", "sk", "op", 6.0) == {"from": A}


async def test_leader_client_no_leader_within_the_timeout(autojump_clock: trio.testing.MockClock) -> None:
    async def request(server: str, key: str, server_key: str, op: Any, timeout: float) -> Any:
        raise NotLeaderError(server, "")

    with pytest.raises(NotLeaderError, match="not known yet"):
        await LeaderClient([A, B], request)("k", "sk", "op", 2.0)


async def test_a_refusal_is_not_retried() -> None:
    calls = []

    async def request(server: str, key: str, server_key: str, op: Any, timeout: float) -> Any:
        calls.append(server)
        raise RequestFailedError("no deployment named 'x'")

    with pytest.raises(RequestFailedError):
        await LeaderClient([A, B], request)("k", "sk", "op", 2.0)
    assert calls == [A]

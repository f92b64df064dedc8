"""Mid-stream failover's shell (router/connection/failover.py) with a fake relay: which
replica goes on, with which body, how many times, and how a stream that cannot go on ends."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from llmgw.http1.request import Request
from llmgw.router.connection.failover import carry_on, follow_for
from llmgw.router.connection.relay import ClientGone, Failed, Migrate
from llmgw.router.exchange import Exchange
from llmgw.router.routing.balancer import Replica
from llmgw.router.routing.priority import EngineBodies

PATH = b"/v1/completions"
EVENT = b'data: {"id":"a","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"%s","logprobs":null,"finish_reason":null}]}'


class FakeMetrics:
    def __init__(self) -> None:
        self.outcomes: list[str] = []

    def failover(self, model: str, outcome: str) -> None:
        self.outcomes.append(outcome)


class FakeRelay:
    """Each run answers from `script` (a status, or an exception to raise) and records the
    replica and the body it was given."""

    def __init__(self, *script: int | BaseException) -> None:
        self.script = list(script)
        self.runs: list[tuple[str, dict[str, Any]]] = []
        self.ended: list[tuple[str, bool]] = []
        self.metrics = FakeMetrics()

    async def run(self, ex: Exchange, r: Replica, t0: float | None = None,
                  deadline: float | None = None) -> int:
        assert ex.body is not None
        self.runs.append((r.replica_id, json.loads(ex.body)))
        got = self.script.pop(0)
        if isinstance(got, BaseException):
            raise got
        return got

    async def end_stream(self, ex: Exchange, why: str, whole: bool = False) -> None:
        self.ended.append((why, whole))


def exchange(body: dict[str, Any], sent: str = "Hello") -> Exchange:
    ex = Exchange(None, Request(b"POST", PATH, {}, b""), PATH, 0.0)
    ex.model = "m"
    ex.follow = follow_for(PATH, body, False)
    assert ex.follow is not None
    ex.follow.stream.observe(EVENT % sent.encode())
    return ex


REPLICAS = [Replica(f"r{i}", f"http://127.0.0.1:{9000 + i}") for i in range(4)]


def chooser(order: list[Replica]) -> Any:
    def choose(tried: tuple[Replica, ...]) -> Replica | None:
        return next((r for r in order if r not in tried), None)
    return choose


async def go(relay: FakeRelay, ex: Exchange, migrations: int = 1, **kw: Any) -> int:
    failed: list[str] = []
    status = await carry_on(relay, ex, chooser(REPLICAS), lambda m, r, why: failed.append(r.replica_id),
                            REPLICAS[0], "replica r0 failed: reset", migrations=migrations, timeout=30,
                            status=200, **kw)
    return status


async def test_goes_on_on_another_replica_with_the_continuation() -> None:
    relay = FakeRelay(200)
    ex = exchange({"model": "m", "prompt": "Say", "max_tokens": 5, "stream": True})
    assert await go(relay, ex) == 200
    assert relay.runs == [("r1", {"model": "m", "prompt": "SayHello", "max_tokens": 4, "stream": True,
                                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}})]
    assert relay.metrics.outcomes == ["resumed"] and relay.ended == []


async def test_a_replica_refusing_before_its_first_byte_is_passed_over() -> None:
    relay = FakeRelay(Failed("engine answered HTTP 503"), 200)
    ex = exchange({"model": "m", "prompt": "Say", "stream": True})
    assert await go(relay, ex) == 200
    assert [r for r, _ in relay.runs] == ["r1", "r2"]
    assert relay.runs[0][1] == relay.runs[1][1]  # the same continuation


async def test_migrations_bounded_then_the_error_event() -> None:
    relay = FakeRelay(Migrate("replica r1 failed: EOF"), 200)
    ex = exchange({"model": "m", "prompt": "Say", "stream": True})
    assert await go(relay, ex, migrations=1) == 200
    assert [r for r, _ in relay.runs] == ["r1"]
    assert relay.ended == [("replica r1 failed: EOF", False)]
    assert relay.metrics.outcomes == ["resumed", "refused"]
    relay = FakeRelay(Migrate("replica r1 failed: EOF"), 200)
    ex = exchange({"model": "m", "prompt": "Say", "stream": True})
    assert await go(relay, ex, migrations=2) == 200
    assert [r for r, _ in relay.runs] == ["r1", "r2"]


async def test_no_replica_left_or_a_refusal_ends_the_stream() -> None:
    relay = FakeRelay(Failed("timeout", retry=False))
    ex = exchange({"model": "m", "prompt": "Say", "stream": True})
    assert await go(relay, ex) == 200
    assert relay.ended and "not resumed: replica r1: timeout" in relay.ended[0][0]
    assert relay.metrics.outcomes == ["failed"]


async def test_finished_answer_ends_with_done_only() -> None:
    relay = FakeRelay()
    ex = exchange({"model": "m", "prompt": "Say", "stream": True})
    assert ex.follow is not None
    ex.follow.stream.observe(b'data: {"id":"a","choices":[{"index":0,"text":"","finish_reason":"stop"}]}')
    assert await go(relay, ex) == 200
    assert relay.runs == [] and relay.ended == [("replica r0 failed: reset", True)]


@pytest.mark.parametrize(("takes", "field"), [(True, 3), (False, None)])
async def test_the_client_s_priority_never_reaches_an_engine(takes: bool, field: int | None) -> None:
    body = {"model": "m", "prompt": "Say", "stream": True, "priority": -1000}
    relay = FakeRelay(200)
    ex = exchange(body)
    ex.engine = EngineBodies(body, None, 3, None)
    assert await go(relay, ex, takes_priority=lambda r: takes) == 200
    sent = relay.runs[0][1]
    assert sent.get("priority") == field
    assert sent["prompt"] == "SayHello"


async def test_client_gone_meanwhile() -> None:
    relay = FakeRelay(ClientGone())
    ex = exchange({"model": "m", "prompt": "Say", "stream": True})
    with trio.fail_after(1):
        assert await go(relay, ex) == 499

"""Priority classes in the router's admission (routing/admission.py over the fair queue,
routing/classes.py, routing/priority.py): round-robin across keys, bands, per-class ttl,
displacement, a request lowering its class, and the `priority` field an engine gets. The
gate runs on trio's autojump clock."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import trio
import trio.testing

from llmgw.config.router import ClassConfig, RouterConfig, RouterKeysConfig
from llmgw.router.errors import ApiError
from llmgw.router.routing.admission import Gate, Refused
from llmgw.router.routing.classes import Classes
from llmgw.router.routing.fairqueue import Band, FairQueue
from llmgw.router.routing.priority import EngineBodies, rewrite
from llmgw.router.tenants.usage import usage_body

HI = Band("interactive", 2, 10.0)
LO = Band("batch", 1, 60.0)


def config(**kw: Any) -> RouterConfig:
    return RouterConfig(server="tcp://127.0.0.1:1", keys=RouterKeysConfig("", ""), **kw)


async def _run(gate: Gate, plan: list[tuple[str, Band | None, str]], hold: float = 1.0,
               capacity: int = 1) -> tuple[list[str], dict[str, str]]:
    """Hold the one slot, queue `plan` (name, band, key) in order, then free the slot:
    the order they were served in, and why each refused one was."""
    served: list[str] = []
    refused: dict[str, str] = {}
    assert gate.try_enter(capacity)

    async def one(name: str, band: Band | None, key: str) -> None:
        try:
            await gate.enter(capacity, trio.current_time(), band, key)
        except Refused as exc:
            refused[name] = exc.why
            return
        served.append(name)
        await trio.sleep(hold)
        gate.leave(capacity)

    async with trio.open_nursery() as n:
        for name, band, key in plan:
            n.start_soon(one, name, band, key)
            await trio.sleep(0.001)  # arrive in order
        gate.leave(capacity)
    assert gate.active == 0 and gate.queued == 0
    return served, refused


async def test_a_flood_from_one_key_does_not_delay_another_beyond_its_turn(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = Gate(100, bands=[HI])
    plan = [(f"a{i}", HI, "A") for i in range(6)] + [("b0", HI, "B"), ("b1", HI, "B")]
    served, refused = await _run(gate, plan)
    assert refused == {}
    # B's first request goes right after A's first: one each, in turn.
    assert served == ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]


async def test_one_key_and_one_class_is_first_come_first_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    served, _ = await _run(Gate(100, wait=100.0), [(str(i), None, "") for i in range(5)])
    assert served == ["0", "1", "2", "3", "4"]


async def test_a_batch_request_waits_behind_an_interactive_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = Gate(100, bands=[HI, LO])
    served, _ = await _run(gate, [("batch", LO, "A"), ("batch2", LO, "B"), ("inter", HI, "A")])
    assert served == ["inter", "batch", "batch2"]


async def test_each_class_waits_its_own_ttl(autojump_clock: trio.testing.MockClock) -> None:
    gate = Gate(100, bands=[HI, LO])
    assert gate.try_enter(1)
    t0 = trio.current_time()
    got: dict[str, tuple[str, float]] = {}

    async def one(name: str, band: Band) -> None:
        try:
            await gate.enter(1, t0, band, name)
        except Refused as exc:
            got[name] = (exc.why, trio.current_time() - t0)
            assert exc.band == band.name
            return
        got[name] = ("served", trio.current_time() - t0)

    async with trio.open_nursery() as n:
        n.start_soon(one, "i", HI)
        n.start_soon(one, "b", LO)
        await trio.sleep(30.0)
        assert gate.waiting("interactive") == 0 and gate.waiting("batch") == 1
        gate.leave(1)
    assert got["i"] == ("queue_timeout", pytest.approx(10.0))
    assert got["b"] == ("served", pytest.approx(30.0))


async def test_a_full_queue_displaces_the_lower_class_and_refuses_the_same_class(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = Gate(2, bands=[HI, LO])
    plan = [("b1", LO, "A"), ("b2", LO, "A"), ("i1", HI, "B"), ("i2", HI, "B"), ("i3", HI, "C")]
    served, refused = await _run(gate, plan)
    assert refused == {"b2": "displaced", "b1": "displaced", "i3": "queue_full"}
    assert served == ["i1", "i2"]
    assert gate.refused == 3


async def test_the_wait_is_returned_and_a_zero_wait_class_never_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = Gate(10, wait=0.0)  # queue_wait = 0, as before classes: refused at once
    assert gate.try_enter(1)
    t0 = trio.current_time()
    with pytest.raises(Refused) as exc:
        await gate.enter(1, t0)
    assert exc.value.why == "queue_timeout" and trio.current_time() == t0
    gate = Gate(10, bands=[HI])
    assert gate.try_enter(1)

    async def free() -> None:
        await trio.sleep(3.0)
        gate.leave(1)

    async with trio.open_nursery() as n:
        n.start_soon(free)
        assert await gate.enter(1, trio.current_time(), HI, "k") == pytest.approx(3.0)
    assert await gate.enter(2, trio.current_time()) == 0.0  # a free slot: no wait


async def test_a_waiter_cancelled_after_its_slot_was_counted_gives_it_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A slot counted for a waiter whose handler was cancelled in the same moment (before
    it ran again) goes to the next one in turn, not lost."""
    gate = Gate(10, bands=[HI])
    assert gate.try_enter(1)
    got: list[str] = []
    first = trio.CancelScope()

    async def waiter(name: str, scope: trio.CancelScope) -> None:
        with scope:
            await gate.enter(1, trio.current_time(), HI, name)
            got.append(name)
            gate.leave(1)

    async with trio.open_nursery() as n:
        n.start_soon(waiter, "first", first)
        await trio.sleep(0.001)
        n.start_soon(waiter, "second", trio.CancelScope())
        await trio.sleep(0.001)
        first.cancel()  # the first waiter's handler is cancelled; before it runs...
        gate.leave(1)  # ...the slot freed is counted for it, still first in the queue
    assert got == ["second"] and gate.active == 0 and gate.queued == 0


# ---- classes ------------------------------------------------------------------------------


def test_no_classes_is_one_default_class_waiting_queue_wait() -> None:
    c = Classes(config(queue_wait=7.0))
    assert c.bands == (Band("default", 0, 7.0),) and c.default is c.bands[0]
    assert c.of_key("k", "") is c.default


def test_keys_and_the_header_choose_the_band(caplog: pytest.LogCaptureFixture) -> None:
    c = Classes(config(classes=(ClassConfig("interactive", 10.0), ClassConfig("standard", 30.0),
                                ClassConfig("batch", 60.0)), default_class="standard"))
    inter, std, batch = c.bands
    assert (inter.rank, std.rank, batch.rank) == (3, 2, 1)
    assert c.of_key("k", "") is std and c.of_key("k", "interactive") is inter
    with caplog.at_level(logging.WARNING, "llmgw.router"):
        assert c.of_key("k", "interactiv") is batch  # a typo never lifts a key
        assert c.of_key("k", "interactiv") is batch
    assert len([r for r in caplog.records if "interactiv" in r.message]) == 1  # logged once
    assert c.band(std, None) is std
    assert c.band(std, b"batch") is batch  # lowered
    assert c.band(std, b"interactive") is std  # never raised
    with pytest.raises(ApiError) as exc:
        c.band(std, b"urgent")
    assert exc.value.status == 400 and exc.value.payload()["error"]["code"] == "unknown_class"
    q: FairQueue[str] = FairQueue(c.bands, 1)
    assert [c.vllm_priority(b) for b in c.bands] == [q.vllm_priority(b) for b in c.bands] == [0, 1, 2]


# ---- the priority field -----------------------------------------------------------------


def test_rewrite_overwrites_or_removes_the_clients_priority() -> None:
    assert rewrite({"model": "m"}, None) is None and rewrite({"model": "m"}, 0) is None
    assert rewrite({"model": "m", "priority": -100}, 0) == {"model": "m", "priority": 0}
    assert rewrite({"model": "m"}, 2) == {"model": "m", "priority": 2}
    assert rewrite({"priority": -5, "model": "m"}, None) == {"model": "m"}


def test_engine_bodies_per_kind_of_engine_and_a_metered_stream() -> None:
    body = {"model": "m", "prompt": "p", "priority": -9}
    raw = json.dumps(body).encode()
    bodies = EngineBodies(body, None, 1, None)
    assert json.loads(bodies.for_engine(True) or b"") == {"model": "m", "prompt": "p", "priority": 1}
    assert json.loads(bodies.for_engine(False) or b"") == {"model": "m", "prompt": "p"}
    assert bodies.for_engine(True) is bodies.for_engine(True)  # made once
    # Nothing to change: the bytes the router would send anyway.
    plain = {"model": "m"}
    assert EngineBodies(plain, None, 0, None).for_engine(True) is None
    assert EngineBodies(plain, b"usage", 0, usage_body).for_engine(False) == b"usage"
    # A metered stream keeps asking the engine for usage.
    stream = {"model": "m", "stream": True, "priority": 3}
    sent = usage_body(stream, json.dumps(stream).encode())
    got = json.loads(EngineBodies(stream, sent, 2, usage_body).for_engine(True) or b"")
    assert got["priority"] == 2 and got["stream_options"] == {"include_usage": True}
    assert json.loads(raw)["priority"] == -9  # the client's own body untouched


def test_a_failover_continuation_gets_the_field_as_its_replica_should() -> None:
    bodies = EngineBodies({"model": "m", "priority": -9}, None, 1, None)
    cont = json.dumps({"model": "m", "prompt": "p and more", "priority": -9}).encode()
    assert json.loads(bodies.for_continuation(cont, True))["priority"] == 1
    assert "priority" not in json.loads(bodies.for_continuation(cont, False))
    plain = json.dumps({"model": "m"}).encode()
    assert EngineBodies({"model": "m"}, None, 0, None).for_continuation(plain, True) is plain

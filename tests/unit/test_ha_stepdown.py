"""A leader stepping down (issue 19), without a database: the requests it had taken are
answered NotLeader at once, a standby never names itself, and a step-down's reason is the
error that ended the term, not the nursery's wrapper."""

from __future__ import annotations

import math
from typing import Any

import trio
import trio.testing

from llmgw import PROTOCOL_VERSION
from llmgw.config.server import ServerConfig
from llmgw.server.peers.service import run_plane
from llmgw.server.peers.sessions import ControlPlane, Outgoing
from llmgw.server.store.leadership import LeaseKeeper, reason
from llmgw.server.store.sql import FencedError, StoreError
from llmgw.transport import codec
from llmgw.transport.keys import KeyInfo
from llmgw.transport.messages import NotLeader, Reply, Request
from llmgw.transport.requests import DeleteOp, StatusOp

ADMIN = "A" * 40


class MemTransport:
    def __init__(self) -> None:
        self.send_in, self.recv_in = trio.open_memory_channel[tuple[bytes, str, bytes]](math.inf)
        self.sent: list[Outgoing] = []

    async def recv_batch(self) -> list[tuple[bytes, str, bytes]]:
        return [await self.recv_in.receive()]

    def send_all(self, out: list[Outgoing]) -> None:
        self.sent.extend(out)


def plane(store_answers: trio.Event) -> ControlPlane:
    cp = ControlPlane(config=ServerConfig(heartbeat_interval=5.0),
                      authorized={ADMIN: KeyInfo("ops", "admin", ADMIN.encode())})

    async def slow_write(peer: Any, op: Any, now: float) -> Any:
        # As the store's calls are: a thread that a cancel cannot interrupt.
        with trio.CancelScope(shield=True):
            await store_answers.wait()
        return {"deleted": True}

    cp.ops[DeleteOp] = (frozenset({"admin"}), slow_write)
    cp.ops[StatusOp] = (frozenset({"admin"}), lambda peer, op, now: {"nodes": []})
    return cp


def request(rid: str, op: Any) -> tuple[bytes, str, bytes]:
    return (b"ctl-" + rid.encode(), ADMIN, codec.encode(Request(PROTOCOL_VERSION, rid, op)))


async def test_requests_pending_at_a_leader_that_steps_down_get_not_leader_at_once(
        autojump_clock: trio.testing.MockClock) -> None:
    store_answers = trio.Event()
    cp, t = plane(store_answers), MemTransport()
    successor = ["tcp://new:7443"]
    async with trio.open_nursery() as nursery:
        term = trio.CancelScope()

        async def leader() -> None:
            with term:
                await run_plane(cp, t, not_leader=lambda: successor[0])

        nursery.start_soon(leader)
        t.send_in.send_nowait(request("pending", DeleteOp("d")))
        t.send_in.send_nowait(request("answered", StatusOp()))
        await trio.sleep(1)
        assert [m.request_id for _, m in t.sent if isinstance(m, Reply)] == ["answered"]
        stepped_down = trio.current_time()
        term.cancel()  # the term ends while the write is still waiting for the database
        await trio.testing.wait_all_tasks_blocked()
        late = [m for _, m in t.sent if isinstance(m, NotLeader)]
        assert late == [NotLeader("tcp://new:7443", "pending")]
        assert trio.current_time() - stepped_down < 1.0
        # The write's thread comes back later: no second answer to the same request.
        store_answers.set()
        await trio.sleep(1)
    assert sum(1 for _, m in t.sent if getattr(m, "request_id", "") == "pending") == 1


async def test_a_single_server_stopping_answers_nothing_extra(
        autojump_clock: trio.testing.MockClock) -> None:
    store_answers = trio.Event()
    cp, t = plane(store_answers), MemTransport()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_plane, cp, t)
        t.send_in.send_nowait(request("pending", DeleteOp("d")))
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
        store_answers.set()
    assert not any(isinstance(m, NotLeader) for _, m in t.sent)


class RowNamesUs:
    """A lease row that still names this server, live: it stepped down on its own clock
    (the margin) before the row ran out."""

    def __init__(self) -> None:
        self.keeper: LeaseKeeper | None = None

    def acquire(self, holder: str, address: str, ttl: float) -> int | None:
        return None

    def current(self) -> tuple[int, str, str, bool]:
        assert self.keeper is not None
        return 3, self.keeper.holder, self.keeper.address, True


async def test_a_standby_never_names_itself_the_leader(autojump_clock: trio.testing.MockClock) -> None:
    lease = RowNamesUs()
    keeper = LeaseKeeper(lease, "tcp://a:7443", 3.0)
    lease.keeper = keeper

    async def direct(fn: Any, *args: Any) -> Any:  # no thread: the mock clock cannot run ahead
        return fn(*args)

    keeper._call = direct
    keeper.leader = keeper.address  # as it was while it led
    with trio.move_on_after(2):
        await keeper.elected()
    assert keeper.leader == "" and keeper.named() == ""
    assert keeper.other("tcp://b:7443", "someone-else", True) == "tcp://b:7443"
    assert keeper.other("tcp://b:7443", "someone-else", False) == ""
    keeper.leader = keeper.address
    assert keeper.named() == ""


def test_a_step_down_reason_is_the_error_inside_the_groups() -> None:
    inner = FencedError("db: write refused: this server led with epoch 4, the lease now says epoch 5")
    nested = ExceptionGroup("Exceptions from Trio nursery", [ExceptionGroup("x", [inner])])
    assert reason(nested) == str(inner)
    assert reason(BaseExceptionGroup("g", [StoreError("db: canceling statement due to statement timeout")])) \
        == "db: canceling statement due to statement timeout"
    assert reason(ExceptionGroup("g", [OSError(113, "No route to host")])) == \
        "OSError: [Errno 113] No route to host"
    assert "Trio nursery" not in reason(nested)

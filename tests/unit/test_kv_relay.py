"""The agent's KV relay core (agent/kvevents/relay.py): how it answers a Follow, row by row,
what it fans out, its bounds, what it forgets; and, under hypothesis, a router that applies
what it is sent over a lossy connection (re-following on a gap, heartbeating) always ends
with the current life's batches as the relay's ring holds them, never a seq applied twice."""

from __future__ import annotations

import random
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.agent.kvevents.relay import Relay
from llmgw.kvcache.events import Batch, Stored
from llmgw.kvcache.relay_wire import FORGET_AFTER, Follow, Gone, Life, Message, RelayBatch, decode

R = "tiny-0"
A, B = b"router-a", b"router-b"


def bat(n: int) -> Batch:
    """A batch whose one stored hash says which it was."""
    return Batch(float(n), 0, None, (Stored((n,), None, (1, 2), 2),))


def tag(m: Message) -> int:
    assert isinstance(m, RelayBatch)
    ev = m.batch.events[0]
    assert isinstance(ev, Stored)
    return int(ev.block_hashes[0])


def sent(out: list[tuple[bytes, list[bytes]]]) -> list[tuple[bytes, Message]]:
    return [(ident, decode(frames)) for ident, frames in out]


FIRST_LIFE = 1000


class Lives(random.Random):
    """Lives 1000, 1001, ... in order of birth, so rows can name them (L0, L1, ...)."""

    def __init__(self) -> None:
        super().__init__(0)
        self.next = FIRST_LIFE

    def randint(self, a: int, b: int) -> int:
        self.next += 1
        return self.next - 1


def show(out: list[tuple[bytes, list[bytes]]]) -> list[str]:
    lines = []
    for ident, m in sent(out):
        who = ident.decode()[-1]
        if isinstance(m, Life):
            lines.append(f"{who} life {m.replica} L{m.life - FIRST_LIFE} from {m.seq}")
        elif isinstance(m, RelayBatch):
            lines.append(f"{who} batch {m.replica} L{m.life - FIRST_LIFE} #{m.seq}={tag(m)}")
        elif isinstance(m, Gone):
            lines.append(f"{who} gone {m.replica}")
    return lines


def new_relay(**kw: Any) -> Relay:
    return Relay(Lives(), **kw)


def test_a_follower_with_nothing_gets_the_life_and_every_held_batch() -> None:
    relay = new_relay()
    relay.new_life(R)
    relay.batch(R, bat(10))
    relay.batch(R, bat(11))
    out = relay.follow(A, Follow({R: None}), 0.0)
    assert show(out) == ["a life tiny-0 L0 from 0", "a batch tiny-0 L0 #0=10",
                                "a batch tiny-0 L0 #1=11"]
    # and from then on, each batch as it comes
    assert show(relay.batch(R, bat(12))) == ["a batch tiny-0 L0 #2=12"]


def follow_rows() -> list[tuple[str, Any, list[str]]]:
    # The relay holds L0 #0..#4 (a ring of 3: #2..#4), then the row's position.
    return [
        ("up to date: nothing", ("L0", 5), []),
        ("behind, held: the batches from its next seq", ("L0", 3),
         ["a batch tiny-0 L0 #3=3", "a batch tiny-0 L0 #4=4"]),
        ("the first held", ("L0", 2),
         ["a batch tiny-0 L0 #2=2", "a batch tiny-0 L0 #3=3", "a batch tiny-0 L0 #4=4"]),
        ("behind past the ring: the life again, from the first held", ("L0", 1),
         ["a life tiny-0 L0 from 2", "a batch tiny-0 L0 #2=2", "a batch tiny-0 L0 #3=3",
          "a batch tiny-0 L0 #4=4"]),
        ("ahead of the relay (never sent): the life again", ("L0", 9),
         ["a life tiny-0 L0 from 2", "a batch tiny-0 L0 #2=2", "a batch tiny-0 L0 #3=3",
          "a batch tiny-0 L0 #4=4"]),
        ("another life (the agent restarted): the life again", (12345, 5),
         ["a life tiny-0 L0 from 2", "a batch tiny-0 L0 #2=2", "a batch tiny-0 L0 #3=3",
          "a batch tiny-0 L0 #4=4"]),
    ]


@pytest.mark.parametrize(("why", "pos", "want"), follow_rows(), ids=[r[0] for r in follow_rows()])
def test_follow_answers(why: str, pos: Any, want: list[str]) -> None:
    relay = new_relay(ring_batches=3)
    relay.new_life(R)
    for n in range(5):
        relay.batch(R, bat(n))
    life = FIRST_LIFE if pos[0] == "L0" else pos[0]
    assert show(relay.follow(A, Follow({R: (life, pos[1])}), 0.0)) == want


def test_a_replica_not_here_is_gone_and_its_start_is_announced_to_who_asked() -> None:
    relay = new_relay()
    assert show(relay.follow(A, Follow({R: None}), 0.0)) == ["a gone tiny-0"]
    assert show(relay.new_life(R)) == ["a life tiny-0 L0 from 0"]
    assert show(relay.batch(R, bat(1))) == ["a batch tiny-0 L0 #0=1"]


def test_restart_and_stop_reach_every_follower_of_that_replica_only() -> None:
    relay = new_relay()
    relay.new_life(R)
    relay.new_life("other")
    relay.follow(A, Follow({R: None}), 0.0)
    relay.follow(B, Follow({R: None, "other": None}), 0.0)
    assert show(relay.batch("other", bat(1))) == ["b batch other L1 #0=1"]
    assert show(relay.new_life(R)) == ["a life tiny-0 L2 from 0", "b life tiny-0 L2 from 0"]
    assert show(relay.batch(R, bat(2))) == ["a batch tiny-0 L2 #0=2", "b batch tiny-0 L2 #0=2"]
    assert show(relay.gone(R)) == ["a gone tiny-0", "b gone tiny-0"]
    assert relay.position(R) is None and relay.held(R) == []
    assert relay.gone(R) == []  # gone twice: nothing more to say


def test_each_life_is_new_and_a_batch_before_any_start_opens_one() -> None:
    relay = new_relay()
    relay.follow(A, Follow({R: None}), 0.0)
    assert show(relay.batch(R, bat(1))) == ["a life tiny-0 L0 from 0", "a batch tiny-0 L0 #0=1"]
    lives = {relay.position(R)}
    for _ in range(20):
        relay.new_life(R)
        lives.add(relay.position(R))
    assert len(lives) == 21


def test_the_ring_is_bounded_by_count_and_by_bytes_and_keeps_the_newest() -> None:
    relay = new_relay(ring_batches=4)
    relay.new_life(R)
    for n in range(10):
        relay.batch(R, bat(n))
    assert [seq for seq, _ in relay.held(R)] == [6, 7, 8, 9]
    size = sum(len(f) for f in relay.held(R)[0][1])
    relay = new_relay(ring_bytes=3 * size)
    relay.new_life(R)
    for n in range(10):
        relay.batch(R, bat(n))
    assert [seq for seq, _ in relay.held(R)] == [7, 8, 9]
    relay = new_relay(ring_bytes=1)  # one batch over the bound alone: still kept
    relay.new_life(R)
    relay.batch(R, bat(1))
    relay.batch(R, bat(2))
    assert [seq for seq, _ in relay.held(R)] == [1]
    assert relay.stats.evicted == 1


def test_silent_followers_and_replicas_not_named_are_forgotten() -> None:
    relay = new_relay()
    relay.new_life(R)
    relay.new_life("other")
    relay.follow(A, Follow({R: None, "other": None}), 0.0)
    relay.follow(B, Follow({R: None}), 0.0)
    # A heartbeats naming R only (and re-follows R on its own), B says nothing.
    relay.follow(A, Follow({R: relay.position(R)}), FORGET_AFTER)
    assert relay.forget(FORGET_AFTER) == []  # not over the bound yet
    assert relay.forget(FORGET_AFTER + 0.5) == [B]
    assert relay.followers() == (A,)
    assert relay.batch("other", bat(1)) == []  # A named it last at 0
    assert [i for i, _ in relay.batch(R, bat(2))] == [A]
    relay.drop(A)
    assert relay.followers() == () and relay.batch(R, bat(3)) == []


def test_followers_are_bounded_the_longest_silent_goes() -> None:
    relay = new_relay(max_followers=2)
    relay.follow(A, Follow({}), 1.0)
    relay.follow(B, Follow({}), 0.0)
    relay.follow(b"router-c", Follow({}), 2.0)
    assert set(relay.followers()) == {A, b"router-c"}


# ---------------------------------------------------------------------------------------------
# A router over a lossy connection


@attrs.define
class Router:
    """What a router does with the relay's messages, per replica: (life, next seq) and the
    batches applied in this life (tags by seq)."""

    ident: bytes
    pos: dict[str, tuple[int, int] | None] = attrs.Factory(dict)
    applied: dict[str, dict[int, int]] = attrs.Factory(dict)

    def take(self, m: Message) -> Follow | None:
        """Apply `m`; a Follow to send when it shows a gap."""
        if isinstance(m, Life):
            self.pos[m.replica] = (m.life, m.seq)
            self.applied[m.replica] = {}
        elif isinstance(m, Gone):
            self.pos[m.replica] = None
            self.applied.pop(m.replica, None)
        elif isinstance(m, RelayBatch):
            pos = self.pos.get(m.replica)
            if pos is not None and pos[0] == m.life and m.seq < pos[1]:
                return None  # one it has: in flight when it asked
            if pos is None or pos[0] != m.life or m.seq > pos[1]:
                return Follow({m.replica: pos})  # a gap, or a life it was not told of
            assert m.seq not in self.applied[m.replica], "a seq applied twice"
            self.applied[m.replica][m.seq] = tag(m)
            self.pos[m.replica] = (m.life, m.seq + 1)
        return None

    def heartbeat(self, replicas: list[str]) -> Follow:
        return Follow({r: self.pos.get(r) for r in replicas})


_REPLICAS = ["r0", "r1"]
_batch = st.tuples(st.just("batch"), st.sampled_from(_REPLICAS))
_deliver = st.tuples(st.just("deliver"), st.integers(1, 6))
# Weighted towards batches and deliveries: restarts and stops are rare beside them.
_step = st.one_of(
    _batch, _batch, _batch, _deliver, _deliver,
    st.tuples(st.just("lose"), st.integers(1, 3)),
    st.tuples(st.just("heartbeat"), st.just("")),
    st.tuples(st.sampled_from(["life", "gone"]), st.sampled_from(_REPLICAS)),
)


@settings(max_examples=400, deadline=None, database=None)
@given(steps=st.lists(_step, max_size=60), ring=st.integers(1, 6))
def test_a_lossy_router_ends_with_the_ring_of_the_current_life(
        steps: list[tuple[str, Any]], ring: int) -> None:
    relay = Relay(random.Random(1), ring_batches=ring)
    router = Router(b"r")
    wire: list[Message] = []  # relay -> router, in order; "lose" drops from its head
    tags = iter(range(10_000))
    now = 0.0

    def to_relay(f: Follow) -> None:
        wire.extend(m for _, m in sent(relay.follow(router.ident, f, now)))

    def deliver(n: int) -> None:
        for _ in range(min(n, len(wire))):
            f = router.take(wire.pop(0))
            if f is not None:
                to_relay(f)

    for r in _REPLICAS:
        relay.new_life(r)
    to_relay(router.heartbeat(_REPLICAS))
    for kind, arg in steps:
        now += 0.1
        if kind == "batch":
            wire.extend(m for _, m in sent(relay.batch(arg, bat(next(tags)))))
        elif kind == "life":
            wire.extend(m for _, m in sent(relay.new_life(arg)))
        elif kind == "gone":
            wire.extend(m for _, m in sent(relay.gone(arg)))
        elif kind == "heartbeat":
            to_relay(router.heartbeat(_REPLICAS))
        elif kind == "deliver":
            deliver(arg)
        else:
            del wire[:arg]
    # Then the connection holds: everything arrives, and a heartbeat settles what was lost.
    for _ in range(3):
        deliver(10**6)
        to_relay(router.heartbeat(_REPLICAS))
    deliver(10**6)
    assert not wire
    for r in _REPLICAS:
        pos = relay.position(r)
        if pos is None:
            assert router.pos.get(r) is None and r not in router.applied
            continue
        assert router.pos[r] == pos
        mine = router.applied[r]
        held = {seq: tag(decode(frames)) for seq, frames in relay.held(r)}
        # What it applied runs without a gap to the relay's next seq and takes in the ring.
        assert sorted(mine) == list(range(min(mine, default=pos[1]), pos[1]))
        assert {s: mine[s] for s in held} == held

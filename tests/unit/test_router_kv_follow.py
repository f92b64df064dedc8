"""The router's follower of one agent's KV-event relay (llmgw.router.kv.follow): each
relay message in each state, then a lossy relay under hypothesis: the index is never given
a batch twice and ends equal to what the agent holds of the replica's current life."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.kvcache.events import Batch
from llmgw.kvcache.relay_wire import Follow, Gone, Life, Message, RelayBatch
from llmgw.router.kv.follow import Apply, Clear, Follower, Outcome


def batch(seq: int) -> Batch:
    return Batch(ts=float(seq), seq=seq, dp_rank=None, events=())


def rb(life: int, seq: int, replica: str = "r1") -> RelayBatch:
    return RelayBatch(replica, life, seq, batch(seq))


def follower(*replicas: str) -> Follower:
    f = Follower()
    f.want(replicas or ("r1",))
    f.follow_message()
    return f


def applied(out: Outcome) -> list[tuple[int, int]]:
    return [(a.life, a.seq) for a in out.actions if isinstance(a, Apply)]


# ---------------------------------------------------------------------------------------
# One message at a time


def test_want_asks_from_nothing_and_follow_names_every_position() -> None:
    f = Follower()
    out = f.want(["r1", "r2"])
    assert out.follow and out.actions == []
    assert f.follow_message() == Follow({"r1": None, "r2": None})
    f.receive(Life("r1", 7, 3))
    assert f.follow_message() == Follow({"r1": (7, 3), "r2": None})


def test_the_same_table_again_asks_nothing() -> None:
    f = follower("r1")
    assert f.want(["r1"]) == Outcome()


def test_life_clears_then_batches_apply_in_order() -> None:
    f = follower()
    assert f.receive(Life("r1", 7, 3)).actions == [Clear("r1", "life")]
    assert applied(f.receive(rb(7, 3))) == [(7, 3)]
    assert applied(f.receive(rb(7, 4))) == [(7, 4)]
    assert f.position("r1") == (7, 5)


@pytest.mark.parametrize(("msg", "dropped"), [
    (rb(7, 3), "duplicate"),  # a batch in flight when the router asked
    (rb(7, 4), "duplicate"),
    (rb(5, 9), "stale"),  # the life before: late
])
def test_duplicates_and_late_batches_are_dropped_without_a_follow(msg: Message, dropped: str) -> None:
    f = follower()
    f.receive(Life("r1", 5, 0))
    f.receive(Life("r1", 7, 3))
    f.receive(rb(7, 3))
    f.receive(rb(7, 4))
    assert f.receive(msg) == Outcome(dropped=dropped)
    assert f.position("r1") == (7, 5)


def test_a_life_the_index_already_follows_clears_nothing() -> None:
    f = follower()
    f.receive(Life("r1", 7, 0))
    f.receive(rb(7, 0))
    f.receive(rb(7, 1))
    assert f.receive(Life("r1", 7, 0)) == Outcome(dropped="duplicate")  # a second Follow's answer
    assert f.receive(Life("r1", 7, 2)) == Outcome(dropped="duplicate")
    assert f.position("r1") == (7, 2)
    # From a seq past what the index has: the agent's ring no longer holds the rest.
    assert f.receive(Life("r1", 7, 5)).actions == [Clear("r1", "life")]
    assert f.position("r1") == (7, 5)


def test_a_late_life_of_the_life_before_is_dropped() -> None:
    f = follower()
    f.receive(Life("r1", 5, 0))
    f.receive(Life("r1", 7, 0))
    assert f.receive(Life("r1", 5, 0)) == Outcome(dropped="stale")
    assert f.position("r1") == (7, 0)


def test_a_gap_is_dropped_and_asks_once_until_the_position_moves() -> None:
    f = follower()
    f.receive(Life("r1", 7, 0))
    f.receive(rb(7, 0))
    assert f.receive(rb(7, 2)) == Outcome(follow=True, dropped="gap")
    assert f.follow_message() == Follow({"r1": (7, 1)})
    assert f.receive(rb(7, 3)) == Outcome(follow=False, dropped="gap")  # the Follow covers it
    assert applied(f.receive(rb(7, 1))) == [(7, 1)]  # the agent's answer
    assert f.receive(rb(7, 5)) == Outcome(follow=True, dropped="gap")  # moved: a new gap asks


def test_a_heartbeat_follow_counts_as_asking() -> None:
    f = follower()
    f.receive(Life("r1", 7, 0))
    f.follow_message()  # the heartbeat, naming (7, 0)
    assert f.receive(rb(7, 1)) == Outcome(follow=False, dropped="gap")


@pytest.mark.parametrize("msg", [rb(9, 0), rb(9, 4)])
def test_a_batch_of_an_unannounced_life_is_a_gap(msg: RelayBatch) -> None:
    f = follower()
    f.receive(Life("r1", 7, 0))
    assert f.receive(msg) == Outcome(follow=True, dropped="gap")
    assert f.position("r1") == (7, 0)


def test_a_batch_before_any_life_waits_for_the_answer_to_the_first_follow() -> None:
    f = follower()  # the first Follow (None) went out: its answer brings the Life
    assert f.receive(rb(7, 0)) == Outcome(follow=False, dropped="gap")


def test_gone_clears_and_stops_asking_until_the_table_names_it_again() -> None:
    f = follower("r1", "r2")
    f.receive(Life("r1", 7, 0))
    assert f.receive(Gone("r1")).actions == [Clear("r1", "gone")]
    assert f.receive(Gone("r1")) == Outcome(dropped="gone")
    assert f.receive(rb(7, 0)) == Outcome(dropped="gone")
    assert f.follow_message() == Follow({"r2": None})
    assert f.want(["r1", "r2"]).follow
    assert f.follow_message() == Follow({"r1": None, "r2": None})


def test_a_life_after_gone_is_followed_again() -> None:
    f = follower()
    f.receive(Gone("r1"))
    assert f.receive(Life("r1", 8, 0)).actions == [Clear("r1", "life")]
    assert applied(f.receive(rb(8, 0))) == [(8, 0)]


def test_replicas_that_leave_the_table_are_cleared_and_no_longer_followed() -> None:
    f = follower("r1", "r2")
    f.receive(Life("r1", 7, 0))
    out = f.want(["r2", "r3"])
    assert out.actions == [Clear("r1", "left")] and out.follow
    assert f.receive(rb(7, 0)) == Outcome(dropped="unfollowed")
    assert f.receive(Life("r1", 7, 0)) == Outcome(dropped="unfollowed")
    assert f.follow_message() == Follow({"r2": None, "r3": None})


def test_messages_for_replicas_not_followed_and_follows_change_nothing() -> None:
    f = follower()
    assert f.receive(Life("zz", 1, 0)) == Outcome(dropped="unfollowed")
    assert f.receive(Gone("zz")) == Outcome(dropped="unfollowed")
    assert f.receive(Follow({"r1": None})) == Outcome(dropped="follow")
    assert f.position("r1") is None


# ---------------------------------------------------------------------------------------
# A lossy relay: an agent as relay_wire describes it, a queue each way that may lose
# messages, and the router carrying out what the follower says.

RING = 3  # batches the agent holds per replica (its ring is bounded)


class Agent:
    def __init__(self) -> None:
        self._ids = itertools.count(100)
        self.life = next(self._ids)
        self.start = 0  # the first seq the ring holds
        self.next = 0

    def ring(self) -> list[tuple[int, int]]:
        return [(self.life, s) for s in range(self.start, self.next)]

    def push(self) -> list[Message]:
        seq = self.next
        self.next += 1
        self.start = max(self.start, self.next - RING)
        return [rb(self.life, seq)]

    def new_life(self) -> list[Message]:
        self.life, self.start, self.next = next(self._ids), 0, 0
        return [Life("r1", self.life, 0)]

    def follow(self, msg: Follow) -> list[Message]:
        pos = msg.positions.get("r1", "absent")
        if pos == "absent":
            return []
        if pos is not None and pos[0] == self.life and self.start <= pos[1] <= self.next:
            return [rb(self.life, s) for s in range(pos[1], self.next)]
        return [Life("r1", self.life, self.start)] + [rb(self.life, s) for _, s in self.ring()]


class Router:
    def __init__(self) -> None:
        self.f = follower()
        self.index: list[tuple[int, int]] = []  # what the index was given since its clear
        self.ever: list[tuple[int, int]] = []

    def take(self, msg: Message) -> Follow | None:
        out = self.f.receive(msg)
        for a in out.actions:
            if isinstance(a, Clear):
                self.index = []
            else:
                self.index.append((a.life, a.seq))
                self.ever.append((a.life, a.seq))
        return self.f.follow_message() if out.follow else None


STEPS = st.lists(st.sampled_from(["push", "push", "push", "life", "deliver", "deliver", "deliver",
                                  "lose", "twice", "heartbeat", "agent_reads", "lose_follow"]),
                 max_size=80)


@settings(max_examples=300, deadline=None)
@given(STEPS)
def test_a_lossy_relay_never_applies_twice_and_ends_equal(steps: list[str]) -> None:
    agent, router = Agent(), Router()
    down: list[Message] = []  # agent -> router
    up: list[Follow] = [Follow({"r1": None})]  # router -> agent: the first Follow
    for step in steps:
        if step == "push":
            down += agent.push()
        elif step == "life":
            down += agent.new_life()
        elif step == "deliver" and down:
            ask = router.take(down.pop(0))
            if ask is not None:
                up.append(ask)
        elif step == "lose" and down:
            down.pop(0)
        elif step == "twice" and down:
            down.insert(0, down[0])
        elif step == "heartbeat":
            up.append(router.f.follow_message())
        elif step == "agent_reads" and up:
            down += agent.follow(up.pop(0))
        elif step == "lose_follow" and up:
            up.pop(0)
    # The network heals: the heartbeat and everything in flight arrive.
    up.append(router.f.follow_message())
    for _ in range(100):
        if not up and not down:
            break
        while up:
            down += agent.follow(up.pop(0))
        while down:
            ask = router.take(down.pop(0))
            if ask is not None:
                up.append(ask)
    assert not up and not down
    assert len(router.ever) == len(set(router.ever))  # nothing applied twice
    # Equal: the index holds the current life in order, through its last batch, and at
    # least what the agent's ring holds.
    assert router.f.position("r1") == (agent.life, agent.next)
    next_seq = agent.next
    assert router.index == [(agent.life, s) for s in range(next_seq - len(router.index), next_seq)]
    assert set(agent.ring()) <= set(router.index)

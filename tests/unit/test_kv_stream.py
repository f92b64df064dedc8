"""One engine's KV-event stream (agent/kvevents/stream.py): the seq tracking, row by row,
and, for any interleaving of live batches, replay answers and ends, the two promises:
never a seq applied twice, never one skipped without a clear between."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.agent.kvevents.stream import MAX_HELD, Action, Apply, Clear, Replay, Stream
from llmgw.kvcache.events import Batch


def b(seq: int, life: int = 0) -> Batch:
    return Batch(float(life), seq, None, ())


def show(actions: list[Action]) -> list[str]:
    out = []
    for a in actions:
        if isinstance(a, Apply):
            out.append(f"apply {a.batch.seq}")
        elif isinstance(a, Clear):
            out.append("clear")
        else:
            out.append(f"replay#{a.ident} from {a.start_seq}")
    return out


def run(steps: list[tuple[Any, ...]]) -> list[str]:
    """Steps: ("live", seq), ("replayed", ident, seq), ("end", ident), ("started", 0)."""
    s = Stream()
    out: list[Action] = []
    for step in steps:
        kind = step[0]
        if kind == "live":
            out += s.live(b(step[1]))
        elif kind == "replayed":
            out += s.replayed(step[1], b(step[2]))
        elif kind == "end":
            out += s.replay_ended(step[1])
        else:
            out += s.engine_started()
    return show(out)


ROWS = [
    ("in order from 0", [("live", 0), ("live", 1), ("live", 2)], ["apply 0", "apply 1", "apply 2"]),
    ("a gap asks the replay from the first missing seq",
     [("live", 0), ("live", 3)], ["apply 0", "replay#1 from 1"]),
    ("a late start asks from 0", [("live", 2)], ["replay#1 from 0"]),
    ("replayed batches fill the gap, the held ones follow",
     [("live", 0), ("live", 3), ("replayed", 1, 1), ("replayed", 1, 2), ("replayed", 1, 3), ("end", 1)],
     ["apply 0", "replay#1 from 1", "apply 1", "apply 2", "apply 3"]),
    ("live batches during the replay are held until they line up",
     [("live", 0), ("live", 2), ("live", 3), ("replayed", 1, 1), ("live", 4)],
     ["apply 0", "replay#1 from 1", "apply 1", "apply 2", "apply 3", "apply 4"]),
    ("a replay that begins past the gap clears and goes on",
     [("live", 0), ("live", 5), ("replayed", 1, 3), ("replayed", 1, 4), ("end", 1)],
     ["apply 0", "replay#1 from 1", "clear", "apply 3", "apply 4", "apply 5"]),
    ("a replay that ends short of the gap clears and goes on from the held",
     [("live", 0), ("live", 5), ("live", 6), ("end", 1)],
     ["apply 0", "replay#1 from 1", "clear", "apply 5", "apply 6"]),
    ("a replay that filled part of the gap is followed by another",
     [("live", 0), ("live", 5), ("replayed", 1, 1), ("end", 1), ("replayed", 2, 2), ("replayed", 2, 3),
      ("replayed", 2, 4), ("end", 2)],
     ["apply 0", "replay#1 from 1", "apply 1", "replay#2 from 2", "apply 2", "apply 3", "apply 4", "apply 5"]),
    ("seq back to 0: the engine restarted",
     [("live", 0), ("live", 1), ("live", 0), ("live", 1)],
     ["apply 0", "apply 1", "clear", "apply 0", "apply 1"]),
    ("seq below the last, not 0: restarted, and its start asked for",
     [("live", 0), ("live", 1), ("live", 2), ("live", 1)],
     ["apply 0", "apply 1", "apply 2", "clear", "replay#1 from 0"]),
    ("a replay that overtook the live socket: late live batches are duplicates",
     [("live", 0), ("live", 2), ("replayed", 1, 1), ("replayed", 1, 2), ("replayed", 1, 3), ("end", 1),
      ("live", 3), ("live", 4)],
     ["apply 0", "replay#1 from 1", "apply 1", "apply 2", "apply 3", "apply 4"]),
    ("replayed duplicates are dropped",
     [("live", 0), ("live", 1), ("live", 3), ("replayed", 1, 0), ("replayed", 1, 1), ("replayed", 1, 2)],
     ["apply 0", "apply 1", "replay#1 from 2", "apply 2", "apply 3"]),
    ("answers of a replay no longer wanted are ignored",
     [("live", 0), ("live", 2), ("live", 0), ("replayed", 1, 1), ("end", 1), ("live", 1)],
     ["apply 0", "replay#1 from 1", "clear", "apply 0", "apply 1"]),
    ("the supervisor's start clears",
     [("live", 0), ("live", 1), ("started", 0), ("live", 0)], ["apply 0", "apply 1", "clear", "apply 0"]),
]


@pytest.mark.parametrize(("steps", "want"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_row(steps: list[tuple[Any, ...]], want: list[str]) -> None:
    assert run(steps) == want


def test_held_batches_are_bounded() -> None:
    s = Stream()
    s.live(b(0))
    for seq in range(2, MAX_HELD + 10):
        s.live(b(seq))
    assert len(s.held) == MAX_HELD and s.stats.dropped == 8
    # The replay fills the first gap; the dropped tail leaves a gap the next replay asks for.
    out = s.replayed(1, b(1))
    assert [a.batch.seq for a in out if isinstance(a, Apply)] == list(range(1, MAX_HELD + 2))
    assert s.expect == MAX_HELD + 2 and not s.held


# ------------------------------------------------------------- any interleaving

step = st.one_of(
    st.tuples(st.just("live"), st.integers(0, 12)),
    st.tuples(st.just("replayed"), st.integers(0, 4), st.integers(0, 12)),
    st.tuples(st.just("end"), st.integers(0, 4)),
    st.tuples(st.just("started"), st.just(0)),
)


def check(actions: list[Action]) -> None:
    """Between two clears (or from the start to the first) the applied seqs run on one by
    one, the first from 0 unless a clear came before it."""
    expect: int | None = 0
    for a in actions:
        if isinstance(a, Clear):
            expect = None
        elif isinstance(a, Apply):
            if expect is not None:
                assert a.batch.seq == expect, (a.batch.seq, expect)
            expect = a.batch.seq + 1


@settings(max_examples=400, deadline=None)
@given(st.lists(step, max_size=40))
def test_any_seqs_never_apply_twice_or_skip_without_a_clear(steps: list[tuple]) -> None:
    s = Stream()
    out: list[Action] = []
    for x in steps:
        if x[0] == "live":
            out += s.live(b(x[1]))
        elif x[0] == "replayed":
            out += s.replayed(x[1], b(x[2]))
        elif x[0] == "end":
            out += s.replay_ended(x[1])
        else:
            out += s.engine_started()
        assert not s.held or s.replaying  # a held batch always has a replay coming for it
    check(out)


@st.composite
def engine_lives(draw: st.DrawFn) -> list[tuple]:
    """A publisher's lives (each numbering from 0) with a lossy live socket and a replay
    buffer of the last few batches, the answers delivered in some order with the live ones."""
    events: list[tuple] = []
    for life in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, 20))
        # The last batch of a life arrives: a lost tail shows only when a later one does.
        lost = draw(st.sets(st.integers(0, n - 2))) if n > 1 else set()
        if life and not draw(st.booleans()):
            events.append(("started", life, 0))  # the supervisor says so
        else:
            lost.discard(0)  # else the restart shows in the seqs: a new life's 0 arrives
        events += [("live", life, seq) for seq in range(n) if seq not in lost]
        events.append(("serve", life, n))  # the shell's replays are answered from this life
    return events


@settings(max_examples=300, deadline=None)
@given(engine_lives(), st.integers(1, 8))
def test_a_lossy_publisher_is_followed_exactly_or_cleared(events: list[tuple], buffer: int) -> None:
    """Against a model of the engine: every applied batch is the current life's batch of
    that seq, lives never mix without a clear between, and a life's batches that the
    buffer still held when asked are never lost."""
    s = Stream()
    out: list[Action] = []
    life, published = 0, 0
    pending: list[Replay] = []

    def serve() -> None:
        while pending:
            r = pending.pop(0)
            lo = max(r.start_seq, published - buffer)
            for seq in range(lo, published):
                out.extend(act(s.replayed(r.ident, b(seq, life))))
            out.extend(act(s.replay_ended(r.ident)))

    def act(actions: list[Action]) -> list[Action]:
        pending.extend(a for a in actions if isinstance(a, Replay))
        return actions

    for kind, lf, n in events:
        if lf != life:
            pending.clear()  # the old engine's replay socket is gone with it
            life, published = lf, 0
        if kind == "started":
            out.extend(s.engine_started())
        elif kind == "live":
            published = n + 1
            out.extend(act(s.live(b(n, life))))
        else:
            published = n
            serve()
    check(out)
    # Lives never mix: between two clears every applied batch is of one life, later
    # lives after earlier ones.
    lives = [int(a.batch.ts) for a in out if isinstance(a, Apply)]
    assert lives == sorted(lives)
    run: set[int] = set()
    for a in out:
        if isinstance(a, Clear):
            run = set()
        elif isinstance(a, Apply):
            run.add(int(a.batch.ts))
            assert len(run) == 1, run
    # The last life is followed to its last batch.
    last = [a.batch.seq for a in out if isinstance(a, Apply) and int(a.batch.ts) == life]
    assert last and last[-1] == published - 1

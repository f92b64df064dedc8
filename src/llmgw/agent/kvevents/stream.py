"""One engine's KV-event stream as the agent receives it: which batches to apply, when to
ask the engine's replay socket for missed ones, and when what the agent knows of the
engine's cache must be thrown away. Pure: batches and replay answers in, actions out; the
trio shell around it owns the sockets and the clock.

The engine's publisher (vLLM 0.32 distributed/kv_events.py ZmqEventPublisher; SGLang's
copy) numbers its batches 0, 1, 2, ... from its start (`itertools.count()`), sends them on
a PUB socket that drops what a slow or absent subscriber misses, and keeps the last
`buffer_steps` (10,000 by default) for its replay ROUTER, which answers a start seq with
every buffered batch from it on, then an end marker. So, per engine:

- the next seq expected starts at 0; a batch with it is applied;
- a batch beyond it is a gap: it is held (bounded, MAX_HELD) and the missing seqs are asked
  of the replay socket (Replay, one at a time, each with its own id: the shell asks on a
  fresh socket and hands back only that id's answers, so a stale answer cannot be taken
  for a new one);
- replayed batches fill the gap in order, and the held ones follow as soon as they line
  up; a replayed seq already applied is a duplicate, dropped;
- a gap the replay cannot fill (its answers begin after the seq wanted, or it ends, or the
  shell gives up on it, having brought nothing of the gap: the engine's buffer no longer
  has it) clears the index and goes on from the first batch it has (Clear); a replay that
  filled part of it is followed by another from where it stopped;
- a live seq at or below the last live one means a new publisher: the engine (or its
  EngineCore) restarted and numbers from 0 again: Clear, then as at the start. (A live
  seq below the one expected but above the last live one is not: a replay, on its own
  socket, overtook batches still on their way over the live one: duplicates.) A restart the seqs do
  not show (the agent missed every batch of the old life up to where the new one is) is
  the supervisor's to tell: engine_started() clears too.

What it never does: apply a seq twice, or go past a missing seq without a Clear between.
"""

from __future__ import annotations

import attrs

from llmgw.kvcache.events import Batch

# Live batches held while a replay fills the gap before them: vLLM's default replay
# buffer, so a replay that is answered at all is never cut short by this bound. Past it,
# the newest live batch is dropped, and the gap it leaves is asked for or cleared later.
MAX_HELD = 10_000


@attrs.frozen
class Apply:
    """Apply the batch to the index, in the order given."""

    batch: Batch


@attrs.frozen
class Clear:
    """Throw away everything the index holds for this engine."""

    reason: str


@attrs.frozen
class Replay:
    """Ask the engine's replay socket for the batches from `start_seq` on, on a fresh
    socket (dropping any replay still in flight); hand its answers back with `ident`."""

    ident: int
    start_seq: int


Action = Apply | Clear | Replay


@attrs.define
class Stats:
    applied: int = 0
    duplicates: int = 0  # replayed batches already applied
    replays: int = 0
    clears: int = 0
    dropped: int = 0  # live batches past MAX_HELD


@attrs.define
class Stream:
    """One engine's stream. `expect`: the next seq to apply; `replaying`: the id of the
    replay in flight (0: none); `held`: live batches past a gap, by seq."""

    expect: int = 0
    replaying: int = 0
    held: dict[int, Batch] = attrs.Factory(dict)
    stats: Stats = attrs.Factory(Stats)
    _last_ident: int = 0
    _replay_start: int = 0
    _live_last: int | None = None  # the last live seq seen

    # ------------------------------------------------------------ inputs

    def live(self, batch: Batch) -> list[Action]:
        """A batch from the PUB socket."""
        out: list[Action] = []
        if self._live_last is not None and batch.seq <= self._live_last:
            # One publisher's live seqs only grow: this is a new one.
            self._reset(out, f"the engine's events start again at seq {batch.seq} (it restarted)")
        self._live_last = batch.seq
        if batch.seq < self.expect:
            # A replay overtook the live socket: applied already.
            self.stats.duplicates += 1
        elif batch.seq == self.expect:
            self._apply(batch, out)
            self._drain(out)
        elif len(self.held) < MAX_HELD:
            self.held[batch.seq] = batch
            if not self.replaying:
                self._replay(out)
        else:
            self.stats.dropped += 1
        return out

    def replayed(self, ident: int, batch: Batch) -> list[Action]:
        """One answer of replay `ident`."""
        out: list[Action] = []
        if ident != self.replaying:
            return out
        if batch.seq < self.expect:
            self.stats.duplicates += 1
            return out
        if batch.seq > self.expect:
            # The engine's buffer no longer reaches back to the seq wanted.
            self._skip(batch.seq, out)
        self._apply(batch, out)
        self._drain(out)
        return out

    def replay_ended(self, ident: int) -> list[Action]:
        """Replay `ident` answered its end marker, or the shell gave up on it (no answer in
        time, a socket error)."""
        out: list[Action] = []
        if ident != self.replaying:
            return out
        self.replaying = 0
        if not self.held:
            return out
        if self.expect == self._replay_start:
            # It brought nothing of the gap: what lay between is in neither the live
            # stream nor the engine's buffer.
            self._skip(min(self.held), out)
            self._drain(out)
        if self.held:
            # A gap it could not have seen (opened after the engine answered), or a second
            # one among the held batches: ask again from here.
            self._replay(out)
        return out

    def engine_started(self) -> list[Action]:
        """The supervisor started (or adopted) the engine afresh."""
        out: list[Action] = []
        self._reset(out, "the engine started")
        return out

    # ------------------------------------------------------------ steps

    def _apply(self, batch: Batch, out: list[Action]) -> None:
        out.append(Apply(batch))
        self.expect = batch.seq + 1
        self.stats.applied += 1

    def _drain(self, out: list[Action]) -> None:
        for seq in sorted(s for s in self.held if s < self.expect):
            del self.held[seq]  # replayed meanwhile: applied already
        while self.expect in self.held:
            self._apply(self.held.pop(self.expect), out)

    def _skip(self, to: int, out: list[Action]) -> None:
        self._clear(out, f"seqs {self.expect}..{to - 1} are lost (not in the engine's replay buffer)")
        self.expect = to

    def _replay(self, out: list[Action]) -> None:
        self._last_ident += 1
        self.replaying = self._last_ident
        self._replay_start = self.expect
        self.stats.replays += 1
        out.append(Replay(self.replaying, self.expect))

    def _reset(self, out: list[Action], reason: str) -> None:
        self._clear(out, reason)
        self.expect = 0
        self.replaying = 0
        self.held.clear()
        self._live_last = None

    def _clear(self, out: list[Action], reason: str) -> None:
        # Said even where nothing was applied since the last one: the index's owner then
        # never keeps an entry across a point where the stream broke.
        out.append(Clear(reason))
        self.stats.clears += 1

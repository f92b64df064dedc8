"""Following one agent's KV-event relay, the pure core: per replica the (life, next seq)
the router has, and what each relay message makes of it (kvcache/relay_wire.py says the
protocol).

One `Follower` per agent endpoint, over the replicas the endpoint table places there:

- `Life`: clear the replica's index; its next batch is `seq` of that life. A Life of the
  life the index follows, from a seq it already has, changes nothing (an answer to a second
  Follow): the index holds that life in order already. One of the life before is late.
- `RelayBatch` of the current life: seq == next is applied (next + 1); seq < next is a
  duplicate (a batch in flight when the router asked), dropped; seq > next is a gap, dropped,
  with one Follow to ask again. A batch of the life before the current one is a late
  duplicate, dropped; of a life not announced yet (its Life was lost), or any batch while the
  router has no position, a gap.
- `Gone`: clear, and stop asking for the replica until the table names it again.
- A replica the table no longer places at this agent: cleared and not followed.

"One Follow" per gap: a Follow carries every position the router has, and the agent answers
each with what the router lacks from there on, so one Follow sent after the router's
position last moved covers every later gap until it moves again. The heartbeat Follow
(FOLLOW_EVERY) is sent whatever happens: it is also what recovers from a lost Follow.

Pure: no sockets, no clock. The caller carries out the actions (`Apply`, `Clear`) and sends
a Follow when `Outcome.follow` says so.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from llmgw.kvcache.events import Batch
from llmgw.kvcache.relay_wire import Follow, Gone, Life, Message, RelayBatch


@attrs.frozen
class Apply:
    replica: str
    batch: Batch
    life: int
    seq: int


@attrs.frozen
class Clear:
    replica: str
    why: str  # "life": a new life; "gone": the agent has no stream; "left": not in the table


Action = Apply | Clear


@attrs.define
class Outcome:
    actions: list[Action] = attrs.Factory(list)
    follow: bool = False  # send a Follow now
    dropped: str = ""  # why the message changed nothing: duplicate, gap, stale, unfollowed, follow


class _State:
    __slots__ = ("position", "asked", "gone", "old_life")

    def __init__(self) -> None:
        self.position: tuple[int, int] | None = None  # (life, next seq); None: nothing yet
        self.asked = False  # a Follow naming `position` went out since it last moved
        self.gone = False  # the agent said Gone: not asked for until the table says again
        self.old_life: int | None = None  # the life before the current one


class Follower:
    """The positions of the replicas the router follows at one agent."""

    def __init__(self) -> None:
        self._replicas: dict[str, _State] = {}

    def replicas(self) -> list[str]:
        return list(self._replicas)

    def position(self, replica: str) -> tuple[int, int] | None:
        s = self._replicas.get(replica)
        return None if s is None else s.position

    def want(self, replicas: Iterable[str]) -> Outcome:
        """The table places `replicas` at this agent now. Replicas that left are cleared;
        new ones, and gone ones the table still names, are asked for (None: from nothing)."""
        wanted = set(replicas)
        out = Outcome()
        for r in [r for r in self._replicas if r not in wanted]:
            del self._replicas[r]
            out.actions.append(Clear(r, "left"))
        for r in sorted(wanted):
            s = self._replicas.get(r)
            if s is None:
                self._replicas[r] = _State()
                out.follow = True
            elif s.gone:
                s.gone = False
                s.asked = False
                out.follow = True
        return out

    def follow_message(self) -> Follow:
        """The Follow to send now: every followed replica's position. Marks them asked."""
        positions: dict[str, tuple[int, int] | None] = {}
        for r, s in self._replicas.items():
            if not s.gone:
                positions[r] = s.position
                s.asked = True
        return Follow(positions)

    def receive(self, msg: Message) -> Outcome:
        if isinstance(msg, Follow):
            return Outcome(dropped="follow")  # a router's message, not an agent's
        s = self._replicas.get(msg.replica)
        if s is None:
            return Outcome(dropped="unfollowed")
        if isinstance(msg, Life):
            pos = s.position
            if pos is not None and pos[0] == msg.life and pos[1] >= msg.seq:
                # The life the index follows, from no later than it has: the agent's answer
                # to a Follow it could not serve from its ring (a second Follow from nothing,
                # say). The index already holds that life in order; nothing to clear.
                return Outcome(dropped="duplicate")
            if msg.life == s.old_life:
                return Outcome(dropped="stale")
            if pos is not None and pos[0] != msg.life:
                s.old_life = pos[0]
            s.position = (msg.life, msg.seq)
            s.asked = False
            s.gone = False
            return Outcome([Clear(msg.replica, "life")])
        if isinstance(msg, Gone):
            if s.gone:
                return Outcome(dropped="gone")
            if s.position is not None:
                s.old_life = s.position[0]
            s.position = None
            s.gone = True
            s.asked = False
            return Outcome([Clear(msg.replica, "gone")])
        return self._batch(s, msg)

    def _batch(self, s: _State, msg: RelayBatch) -> Outcome:
        if s.gone:
            return Outcome(dropped="gone")
        pos = s.position
        if pos is not None and msg.life == pos[0]:
            if msg.seq == pos[1]:
                s.position = (pos[0], pos[1] + 1)
                s.asked = False
                return Outcome([Apply(msg.replica, msg.batch, msg.life, msg.seq)])
            if msg.seq < pos[1]:
                return Outcome(dropped="duplicate")
        elif msg.life == s.old_life:
            return Outcome(dropped="stale")
        # A seq past the next, a life not announced, or no position yet: ask once.
        ask = not s.asked
        s.asked = True
        return Outcome(follow=ask, dropped="gap")

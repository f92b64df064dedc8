"""The agent's relay of its engines' KV-event batches to the routers that follow them
(kvcache/relay_wire.py holds the protocol and its rules). Pure: what happened in, the
frames to send out as (the follower's ZMQ identity, the message's frames); time is passed
in. The trio shell (relay_serve.py) owns the ROUTER socket and sends what this returns.

Per replica: its current life (a random 63-bit id from the injected `random.Random`), the
next seq of that life, and a ring of the life's latest batches, each kept as its frames,
encoded once and shared by every send (a decoded batch, held as Python objects, would
take several times the bytes). The ring is bounded by count and by bytes (RING_BATCHES,
RING_BYTES: see there why those). Per follower (a router's DEALER, by the identity the
ROUTER gave it): when it was last heard and each replica it named, with when.

A Follow adds the replicas it names to what its sender follows (a router may re-follow
one replica after a gap, or all of them at its heartbeat); a replica not named for
FORGET_AFTER, and a follower silent that long, are forgotten. A follower told Gone keeps
following: when the replica's engine starts here it is sent the new Life at once, rather
than at its next heartbeat.
"""

from __future__ import annotations

import random
from collections import deque

import attrs

from llmgw.kvcache.events import Batch
from llmgw.kvcache.relay_wire import (
    FORGET_AFTER,
    MAX_FOLLOW,
    Follow,
    Gone,
    Life,
    RelayBatch,
    encode,
)

# A router that re-follows after a short absence (a reconnect, a message dropped at its
# high-water mark, a heartbeat late) should get what it lacks, not a Life that clears what
# it had and leaves it with only the ring: at a few hundred scheduler steps with events a
# second, 4096 batches hold well over FOLLOW_EVERY of them. The bytes bound keeps a node's
# worst case small beside the engines (a long prefill's batch is a few hundred KiB of
# msgpack; 32 MiB a replica, 8 replicas 256 MiB); one batch is always kept, whatever its
# size (the engine-event decoder bounds it to MAX_PAYLOAD).
RING_BATCHES = 4096
RING_BYTES = 32 * 1024 * 1024
# Routers each dial once; identities past this (reconnects faster than FORGET_AFTER
# forgets the old ones) push out the one heard from longest ago.
MAX_FOLLOWERS = 1024
_U63 = (1 << 63) - 1

Frames = list[bytes]
Out = list[tuple[bytes, Frames]]  # (a follower's identity, one message's frames)


@attrs.define
class _Stream:
    """One replica's current life and its ring: (seq, frames), seqs without gaps."""

    life: int
    next_seq: int = 0
    ring: deque[tuple[int, Frames]] = attrs.Factory(deque)
    size: int = 0  # bytes of the frames in the ring

    def first(self) -> int:
        return self.ring[0][0] if self.ring else self.next_seq


@attrs.define
class _Follower:
    heard: float
    follows: dict[str, float] = attrs.Factory(dict)  # replica -> when it was last named


@attrs.define
class Stats:
    batches: int = 0
    lives: int = 0
    evicted: int = 0  # batches pushed out of a ring by its bounds
    caught_up: int = 0  # batches sent from a ring in answer to a Follow
    restarted: int = 0  # Follows answered with a Life (the follower's position was no use)


class Relay:
    def __init__(self, rng: random.Random, *, ring_batches: int = RING_BATCHES,
                 ring_bytes: int = RING_BYTES, max_followers: int = MAX_FOLLOWERS) -> None:
        self._rng = rng
        self._ring_batches, self._ring_bytes = ring_batches, ring_bytes
        self._max_followers = max_followers
        self._streams: dict[str, _Stream] = {}
        self._followers: dict[bytes, _Follower] = {}
        self.stats = Stats()

    # ---- what the relay holds (for tests, metrics and the shell's log lines)

    def replicas(self) -> tuple[str, ...]:
        return tuple(self._streams)

    def followers(self) -> tuple[bytes, ...]:
        return tuple(self._followers)

    def position(self, replica: str) -> tuple[int, int] | None:
        """(life, next seq) of `replica`, None when it has no stream here."""
        s = self._streams.get(replica)
        return None if s is None else (s.life, s.next_seq)

    def held(self, replica: str) -> list[tuple[int, Frames]]:
        s = self._streams.get(replica)
        return [] if s is None else list(s.ring)

    # ---- the engines' side

    def new_life(self, replica: str) -> Out:
        """What the relay held of `replica` no longer describes its engine (it started or
        restarted, or its stream broke): a new life, announced to its followers."""
        life = self._rng.randint(0, _U63)
        while (old := self._streams.get(replica)) is not None and old.life == life:
            life = self._rng.randint(0, _U63)  # a new life is never taken for the old one
        self._streams[replica] = _Stream(life)
        self.stats.lives += 1
        return self._to_followers(replica, encode(Life(replica, life, 0)))

    def batch(self, replica: str, batch: Batch) -> Out:
        """The engine's next batch: numbered, kept in the ring, sent to the followers."""
        out: Out = []
        s = self._streams.get(replica)
        if s is None:  # a batch before any start: a life of its own all the same
            out += self.new_life(replica)
            s = self._streams[replica]
        frames = encode(RelayBatch(replica, s.life, s.next_seq, batch))
        s.ring.append((s.next_seq, frames))
        s.size += sum(len(f) for f in frames)
        s.next_seq += 1
        self.stats.batches += 1
        while len(s.ring) > self._ring_batches or (s.size > self._ring_bytes and len(s.ring) > 1):
            _, old = s.ring.popleft()
            s.size -= sum(len(f) for f in old)
            self.stats.evicted += 1
        out += self._to_followers(replica, frames)
        return out

    def gone(self, replica: str) -> Out:
        """No stream for `replica` here any more (its engine stopped): Gone to followers."""
        if self._streams.pop(replica, None) is None:
            return []
        return self._to_followers(replica, encode(Gone(replica)))

    # ---- the routers' side

    def follow(self, ident: bytes, msg: Follow, now: float) -> Out:
        """A Follow from `ident`: it is heard, follows what it names, and gets, for each
        replica, what it lacks."""
        f = self._followers.get(ident)
        if f is None:
            if len(self._followers) >= self._max_followers:
                oldest = min(self._followers, key=lambda k: self._followers[k].heard)
                del self._followers[oldest]
            f = self._followers[ident] = _Follower(now)
        f.heard = now
        out: Out = []
        for replica, pos in msg.positions.items():
            f.follows.pop(replica, None)  # named again: to the end, the newest
            f.follows[replica] = now
            out += [(ident, frames) for frames in self._catch_up(replica, pos)]
        while len(f.follows) > MAX_FOLLOW:
            del f.follows[next(iter(f.follows))]
        return out

    def _catch_up(self, replica: str, pos: tuple[int, int] | None) -> list[Frames]:
        s = self._streams.get(replica)
        if s is None:
            return [encode(Gone(replica))]
        if pos is not None and pos[0] == s.life and s.first() <= pos[1] <= s.next_seq:
            skip = pos[1] - s.first()
            self.stats.caught_up += len(s.ring) - skip
            return [frames for i, (_, frames) in enumerate(s.ring) if i >= skip]
        # Nothing yet, another life, or a seq the ring no longer holds (or never sent):
        # start again from what the ring holds.
        self.stats.restarted += pos is not None
        self.stats.caught_up += len(s.ring)
        return [encode(Life(replica, s.life, s.first())), *(frames for _, frames in s.ring)]

    def drop(self, ident: bytes) -> None:
        """`ident`'s connection is gone (the socket said so): forget it now."""
        self._followers.pop(ident, None)

    def forget(self, now: float) -> list[bytes]:
        """Forget followers silent for over FORGET_AFTER, and replicas a follower has not
        named that long; the identities forgotten."""
        gone = [k for k, f in self._followers.items() if now - f.heard > FORGET_AFTER]
        for k in gone:
            del self._followers[k]
        for f in self._followers.values():
            for r in [r for r, t in f.follows.items() if now - t > FORGET_AFTER]:
                del f.follows[r]
        return gone

    def _to_followers(self, replica: str, frames: Frames) -> Out:
        return [(k, frames) for k, f in self._followers.items() if replica in f.follows]

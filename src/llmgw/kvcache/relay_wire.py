"""The KV-event relay between an agent and the routers, as frames: pure encode and a total
decode.

Each agent relays its engines' KV-cache events to every router that follows them, on a
ROUTER socket of its own (CURVE server, routers authorized by key); a router dials it with
a DEALER. The engines' formats stop at the agent: it decodes what they publish
(kvcache/events.py, both of vLLM's encodings and SGLang's) and relays llmgw's own, so a
router never meets an engine's format change.

Per replica the agent numbers what it relays in *lives*: a life is a random 63-bit id and
its batches are numbered from 0 with no gaps. A new life begins whenever what came before
no longer describes the engine: the engine started or restarted, the agent itself started
(engines outlive it; what it held is gone), or the engine's stream had a gap its replay
could not fill. A router applies a life's batches in seq order, exactly once:

- Router -> agent, `Follow`: for each replica it wants, the (life, next seq) it has, or
  None for nothing yet. Sent on connect, when the router's table changes, on a gap, and
  every FOLLOW_EVERY seconds (the agent forgets a router silent for FORGET_AFTER, and a
  restarted agent learns of its routers this way). The agent answers each replica with
  what the router lacks from its bounded ring: the batches from next seq on when it holds
  them, else `Life` then every batch it holds of the current life. A router may get a
  batch twice (one in flight when it asked): seq says so, and it is dropped.
- Agent -> router, `Life`: clear this replica's index; its next batch is `seq` of `life`.
  `Batch`: one batch, its life and seq. `Gone`: the agent has no such stream (the engine
  stopped, or relays no events): clear the replica and stop asking until the table says
  otherwise.

Frames: `[PROTO, kind, ...]`, ints 8 bytes big-endian, the follow map and the batches as
msgpack. A batch is relayed in vLLM's current encoding of `EventBatch` (tagged maps,
optional fields left out; vLLM's own decoder reads it: tests/real_engine/
test_kv_events_codec.py), so `events.decode_batch`, the one total decoder, reads it back; the
seq frame of that decoder is the relay's seq.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import msgpack

from llmgw.kvcache.events import (
    MAX_TOPIC,
    Batch,
    Cleared,
    Event,
    KvEventError,
    Removed,
    Stored,
    decode_batch,
)

PROTO = b"llmgw-kv/1"
FOLLOW_EVERY = 5.0  # seconds between a router's Follow messages to one agent
FORGET_AFTER = 3 * FOLLOW_EVERY  # an agent forgets a router that said nothing this long
MAX_FOLLOW = 4096  # replicas one Follow may name (a node runs a handful)
_U63 = (1 << 63) - 1
_U64 = (1 << 64) - 1


@attrs.frozen
class Follow:
    """Router -> agent: replica id -> (life, next seq) the router has, or None."""

    positions: Mapping[str, tuple[int, int] | None]


@attrs.frozen
class Life:
    """Agent -> router: clear `replica`; its next batch is `seq` of `life`."""

    replica: str
    life: int
    seq: int


@attrs.frozen
class RelayBatch:
    """Agent -> router: batch number `seq` of `life` for `replica`."""

    replica: str
    life: int
    seq: int
    batch: Batch


@attrs.frozen
class Gone:
    """Agent -> router: no stream for `replica` here; clear it."""

    replica: str


Message = Follow | Life | RelayBatch | Gone


class RelayError(KvEventError):
    """Frames on the relay socket that are not a relay message llmgw can read."""


def _u64(n: int) -> bytes:
    return n.to_bytes(8, "big")


def encode(msg: Message) -> list[bytes]:
    if isinstance(msg, Follow):
        body = {r: (None if p is None else [p[0], p[1]]) for r, p in msg.positions.items()}
        return [PROTO, b"follow", msgpack.packb(body, use_bin_type=True)]
    if isinstance(msg, Life):
        return [PROTO, b"life", msg.replica.encode(), _u64(msg.life), _u64(msg.seq)]
    if isinstance(msg, RelayBatch):
        return [PROTO, b"batch", msg.replica.encode(), _u64(msg.life), _u64(msg.seq),
                encode_batch(msg.batch)]
    return [PROTO, b"gone", msg.replica.encode()]


def encode_batch(batch: Batch) -> bytes:
    """`batch` as vLLM 0.32 encodes an EventBatch: `[ts, events, rank]`, each event a
    tagged map without the fields that have defaults when they hold them."""
    return msgpack.packb([batch.ts, [_event(e) for e in batch.events], batch.dp_rank],
                         use_bin_type=True)


def _event(e: Event) -> dict[str, Any]:
    if isinstance(e, Stored):
        # vLLM's BlockStored requires its first seven fields, None or not
        # (vllm/distributed/kv_events.py BlockStored: no defaults up to lora_name).
        out: dict[str, Any] = {"type": "BlockStored", "block_hashes": list(e.block_hashes),
                               "parent_block_hash": e.parent, "token_ids": list(e.token_ids),
                               "block_size": e.block_size, "lora_id": e.lora_id,
                               "medium": e.medium, "lora_name": e.lora_name}
        for name, v in (("group_idx", e.group), ("cache_salt", e.cache_salt)):
            if v is not None:
                out[name] = v
        if e.extra_keys is not None:
            out["extra_keys"] = _plain(e.extra_keys)
        return out
    if isinstance(e, Removed):
        out = {"type": "BlockRemoved", "block_hashes": list(e.block_hashes), "medium": e.medium}
        if e.group is not None:
            out["group_idx"] = e.group
        return out
    assert isinstance(e, Cleared)
    return {"type": "AllBlocksCleared"}


def _plain(v: Any) -> Any:
    return [_plain(x) for x in v] if isinstance(v, tuple) else v


def decode(frames: list[bytes]) -> Message:
    """The message in `frames`, or RelayError (or KvEventError from the batch decoder).
    Total: any frames give one of these."""
    if len(frames) < 3 or frames[0] != PROTO:
        raise RelayError("kv relay: not an llmgw-kv/1 message")
    kind = frames[1]
    if kind == b"follow" and len(frames) == 3:
        return Follow(_positions(frames[2]))
    replica = _replica(frames[2])
    if kind == b"gone" and len(frames) == 3:
        return Gone(replica)
    if kind == b"life" and len(frames) == 5:
        return Life(replica, _int(frames[3], _U63, "life"), _int(frames[4], _U64, "seq"))
    if kind == b"batch" and len(frames) == 6:
        life = _int(frames[3], _U63, "life")
        seq = _int(frames[4], _U64, "seq")
        return RelayBatch(replica, life, seq, decode_batch(b"", frames[4], frames[5]))
    raise RelayError(f"kv relay: a {kind[:16]!r} message of {len(frames)} frames")


def _replica(raw: bytes) -> str:
    if not 0 < len(raw) <= MAX_TOPIC:
        raise RelayError("kv relay: replica id empty or too long")
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise RelayError("kv relay: replica id is not UTF-8") from None


def _int(raw: bytes, top: int, name: str) -> int:
    if len(raw) != 8:
        raise RelayError(f"kv relay: {name} is not 8 bytes")
    n = int.from_bytes(raw, "big")
    if n > top:
        raise RelayError(f"kv relay: {name} out of range")
    return n


def _positions(raw: bytes) -> dict[str, tuple[int, int] | None]:
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_map_len=MAX_FOLLOW,
                               max_array_len=2, max_str_len=MAX_TOPIC, max_bin_len=0,
                               max_ext_len=0)
    except Exception as e:  # noqa: BLE001 - msgpack's decoder raises no closed set
        raise RelayError(f"kv relay: follow is not msgpack ({type(e).__name__})") from None
    if not isinstance(body, dict):
        raise RelayError("kv relay: follow is not a map")
    out: dict[str, tuple[int, int] | None] = {}
    for r, p in body.items():
        if not isinstance(r, str) or not 0 < len(r.encode()) <= MAX_TOPIC:
            raise RelayError("kv relay: follow names a bad replica id")
        if p is None:
            out[r] = None
        elif (isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p)
              and 0 <= p[0] <= _U63 and 0 <= p[1] <= _U64):
            out[r] = (p[0], p[1])
        else:
            raise RelayError("kv relay: a follow position is not [life, seq]")
    return out

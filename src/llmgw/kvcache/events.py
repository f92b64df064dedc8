"""The engines' KV-cache events, decoded: one total parser from the three frames an
engine's publisher sends to a typed `Batch`, or a `KvEventError`.

The contract is the engines' own code (vLLM 0.32, vllm/distributed/kv_events.py):

- Frames: multipart `[topic, seq, payload]` (`ZmqEventPublisher._publisher_thread`,
  kv_events.py:494-499); seq counts from 0 per publisher (`itertools.count()`, :374), so
  an engine restart numbers from 0 again; 8 bytes big-endian (:498).
- Payload: msgpack of `EventBatch` (:31-39), `array_like=True`: `[ts, events,
  data_parallel_rank]`. The publisher fills the rank in before encoding (:392-393).
- Events: `KVCacheEvent` is `tag=True` (:42-48). In 0.32 it is not `array_like`, so each
  event is a tagged map `{"type": "BlockStored", "block_hashes": ..., ...}`, defaults
  left out (`omit_defaults`). Before vLLM PR 42892 events were tagged arrays
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...]` in that field order
  (:56-94), trailing defaults trimmed. Both are decoded; unknown map keys and trailing
  array items are ignored, missing optional fields read as None.
- Block hashes are `ExternalBlockHash = bytes | int` (vllm/v1/core/kv_cache_utils.py:71):
  kept as opaque hashable values.
- One `BlockStored` may carry several blocks: `token_ids` then spans them all
  (vllm/v1/core/block_pool.py:311-313, 363-374); null or masked blocks (sliding window,
  Mamba) are left out of `block_hashes` but not of `token_ids`, so the two need not line
  up (block_pool.py:273-278). Blocks reused from the prefix cache are announced again as
  `BlockStored` (block_pool.py:546, `emit_cached_block_events`).
- Replay: a subscriber sends the first seq it wants, 8 bytes big-endian, to the replay
  ROUTER socket (kv_events.py:513-518); 0.32 answers `[b"", topic, seq, payload]` per
  buffered batch and ends with `[b"", b"", END_SEQ, b""]`, END_SEQ being -1 signed
  (:332, 520-527). Before the topic frame was added the answers were `[b"", seq, payload]`
  and `[b"", END_SEQ, b""]`. `replay_frames` reads both.

SGLang (python/sglang/srt/disaggregation/kv_events.py) copies the publisher and frames;
its differences: the batch's third item is `attn_dp_rank`; block hashes are ints only;
`BlockStored` has no `lora_name`, no `extra_keys` and no `group_idx` (block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium); a salted store in the array
encoding adds an 8th item, a map `{"cache_salt": ...}` (`BlockStoredWithMetadata`), where
vLLM has `lora_name` (a string): the two are told apart by type. Newer SGLang also moved
to tagged maps, with `cache_salt` and `session_id` as map keys. Its media are "GPU",
"CPU_PINNED", "DISK", "EXTERNAL" (vLLM's: "GPU", "CPU", "STORAGE").
"""

from __future__ import annotations

from typing import Any

import attrs
import msgpack

from llmgw.errors import ProtocolError

BlockHash = int | bytes

# Bounds on the work one batch may ask for. A vLLM batch is one scheduler step's events;
# a 128k-token prefill is 128k token ids, well inside these.
MAX_PAYLOAD = 16 * 1024 * 1024
MAX_EVENTS = 65_536
MAX_TOKENS = 1 << 20  # token ids in one batch, all events together
MAX_HASHES = 1 << 17  # block hashes in one batch, all events together
MAX_EXTRA_ITEMS = 1 << 16  # items inside extra_keys in one batch, all events together
MAX_STR = 1024  # lora names, media, cache salts, strings inside extra keys
MAX_HASH_BYTES = 64  # a sha256 digest is 32
MAX_TOPIC = 1024
SEQ_LEN = 8
END_SEQ = b"\xff" * SEQ_LEN  # (-1).to_bytes(8, "big", signed=True), the replay's end
_INT64 = (-(1 << 63), (1 << 63) - 1)
_UINT64_MAX = (1 << 64) - 1


class KvEventError(ProtocolError):
    """Frames from an engine's KV-event publisher that are not a batch llmgw can read."""


@attrs.frozen
class Stored:
    """Blocks the engine cached (`BlockStored`). `token_ids` spans every block in
    `block_hashes` when both line up (len(token_ids) == len(block_hashes) * block_size)."""

    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    lora_id: int | None = None
    medium: str | None = None
    group: int | None = None  # vLLM's group_idx (KV-cache group of a hybrid model)
    # vLLM: one entry per block, None or a tuple (lora name, (mm id, offset) pairs, cache
    # salt, prompt-embedding digests), lists made tuples. Opaque here.
    extra_keys: tuple[Any, ...] | None = None
    cache_salt: str | None = None  # SGLang's metadata


@attrs.frozen
class Removed:
    """Blocks the engine evicted (`BlockRemoved`)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group: int | None = None


@attrs.frozen
class Cleared:
    """The engine dropped its whole prefix cache (`AllBlocksCleared`, e.g. on reset)."""


Event = Stored | Removed | Cleared


@attrs.frozen
class Batch:
    ts: float
    seq: int
    dp_rank: int | None
    events: tuple[Event, ...]


@attrs.define
class _Budget:
    """What is left of one batch's bounds while it is walked."""

    tokens: int = MAX_TOKENS
    hashes: int = MAX_HASHES
    extra: int = MAX_EXTRA_ITEMS

    def take(self, what: str, n: int) -> None:
        left = getattr(self, what) - n
        if left < 0:
            raise KvEventError(f"kv events: more {what} in one batch than the bound")
        setattr(self, what, left)


def decode_seq(seq: bytes) -> int:
    if not isinstance(seq, bytes) or len(seq) != SEQ_LEN:
        raise KvEventError(f"kv events: seq frame is not {SEQ_LEN} bytes")
    return int.from_bytes(seq, "big")


def is_replay_end(seq: bytes) -> bool:
    """The replay's end marker (its payload frame is empty)."""
    return seq == END_SEQ


def replay_request(start_seq: int) -> bytes:
    """What a subscriber sends to the replay socket to get batches from `start_seq` on."""
    if not 0 <= start_seq <= _UINT64_MAX:
        raise ValueError(f"replay start {start_seq} is not an unsigned 64-bit seq")
    return start_seq.to_bytes(SEQ_LEN, "big")


def replay_frames(frames: list[bytes]) -> tuple[bytes, bytes, bytes]:
    """(topic, seq, payload) from one replay answer as a DEALER receives it (the empty
    delimiter first): vLLM 0.32's `[b"", topic, seq, payload]` or the older
    `[b"", seq, payload]` (topic b"")."""
    if frames and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 3:
        return frames[0], frames[1], frames[2]
    if len(frames) == 2:
        return b"", frames[0], frames[1]
    raise KvEventError(f"kv events: a replay answer of {len(frames)} frames")


def decode_batch(topic: bytes, seq: bytes, payload: bytes) -> Batch:
    """The batch in one publisher message, or KvEventError. Total: any bytes give one of
    the two, in work bounded by the MAX_* figures above."""
    if not isinstance(topic, bytes) or len(topic) > MAX_TOPIC:
        raise KvEventError("kv events: topic frame too long")
    n = decode_seq(seq)
    if not isinstance(payload, bytes) or len(payload) > MAX_PAYLOAD:
        raise KvEventError("kv events: payload over the size bound")
    try:
        raw = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_STR * 4,
            max_bin_len=MAX_HASH_BYTES * 4,
            max_array_len=MAX_TOKENS,
            max_map_len=64,
            max_ext_len=0,
        )
    # msgpack's C decoder does not promise a closed set of exceptions (ExtraData,
    # FormatError, StackError, UnicodeDecodeError, TypeError, ...): any of them is one
    # unreadable message.
    except Exception as e:  # noqa: BLE001
        raise KvEventError(f"kv events: payload is not msgpack ({type(e).__name__})") from None
    return _batch(raw, n)


def _batch(raw: object, seq: int) -> Batch:
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict) and "ts" in raw and "events" in raw:
        # An EventBatch without array_like (as some vLLM builds had) is a map.
        ts, events = raw["ts"], raw["events"]
        rank = raw.get("data_parallel_rank", raw.get("attn_dp_rank"))
    else:
        raise KvEventError("kv events: payload is not an EventBatch [ts, events, rank]")
    if type(ts) not in (float, int):
        raise KvEventError("kv events: batch ts is not a number")
    if not isinstance(events, list) or len(events) > MAX_EVENTS:
        raise KvEventError("kv events: batch events is not a list within the bound")
    budget = _Budget()
    return Batch(
        ts=float(ts),
        seq=seq,
        dp_rank=_opt_int(rank, "data_parallel_rank"),
        events=tuple(_event(e, budget) for e in events),
    )


# Field order of the array encoding (vLLM's declaration order, kv_events.py:56-94 and
# 116-123; SGLang's is the same prefix). Index 6 of a store is vLLM's lora_name or
# SGLang's metadata map.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _event(raw: object, budget: _Budget) -> Event:
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields: dict[str, object] = raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS
        fields = dict(zip(names, raw[1:], strict=False))
        if tag == "BlockStored" and isinstance(fields.get("lora_name"), dict):
            fields["metadata"] = fields.pop("lora_name")
    else:
        raise KvEventError("kv events: an event is neither a tagged map nor a tagged array")
    if tag == "BlockStored":
        return _stored(fields, budget)
    if tag == "BlockRemoved":
        return Removed(
            block_hashes=_hashes(fields.get("block_hashes"), budget),
            medium=_opt_str(fields.get("medium"), "medium"),
            group=_opt_int(fields.get("group_idx"), "group_idx"),
        )
    if tag == "AllBlocksCleared":
        return Cleared()
    raise KvEventError(f"kv events: unknown event type {str(tag)[:40]!r}")


def _stored(f: dict[str, object], budget: _Budget) -> Stored:
    tokens = f.get("token_ids")
    if not isinstance(tokens, list):
        raise KvEventError("kv events: BlockStored token_ids is not a list")
    budget.take("tokens", len(tokens))
    for t in tokens:
        if type(t) is not int or not _INT64[0] <= t <= _INT64[1]:
            raise KvEventError("kv events: a token id is not a 64-bit int")
    size = f.get("block_size")
    if type(size) is not int or not 0 < size <= MAX_TOKENS:
        raise KvEventError("kv events: BlockStored block_size is not a positive int")
    parent = f.get("parent_block_hash")
    salt = f.get("cache_salt")
    meta = f.get("metadata")
    if isinstance(meta, dict) and salt is None:
        salt = meta.get("cache_salt")
    return Stored(
        block_hashes=_hashes(f.get("block_hashes"), budget),
        parent=None if parent is None else _hash(parent),
        token_ids=tuple(tokens),
        block_size=size,
        lora_name=_opt_str(f.get("lora_name"), "lora_name"),
        lora_id=_opt_int(f.get("lora_id"), "lora_id"),
        medium=_opt_str(f.get("medium"), "medium"),
        group=_opt_int(f.get("group_idx"), "group_idx"),
        extra_keys=_extra(f.get("extra_keys"), budget),
        cache_salt=_opt_str(salt, "cache_salt"),
    )


def _hash(v: object) -> BlockHash:
    if type(v) is int and _INT64[0] <= v <= _UINT64_MAX:
        return v
    if type(v) is bytes and 0 < len(v) <= MAX_HASH_BYTES:
        return v
    raise KvEventError("kv events: a block hash is neither a 64-bit int nor short bytes")


def _hashes(v: object, budget: _Budget) -> tuple[BlockHash, ...]:
    if not isinstance(v, list):
        raise KvEventError("kv events: block_hashes is not a list")
    budget.take("hashes", len(v))
    return tuple(_hash(h) for h in v)


def _opt_int(v: object, name: str) -> int | None:
    if v is None:
        return None
    if type(v) is not int or not _INT64[0] <= v <= _INT64[1]:
        raise KvEventError(f"kv events: {name} is not an int")
    return v


def _opt_str(v: object, name: str) -> str | None:
    if v is None:
        return None
    if type(v) is not str or len(v) > MAX_STR:
        raise KvEventError(f"kv events: {name} is not a short string")
    return v


def _extra(v: object, budget: _Budget) -> tuple[Any, ...] | None:
    """vLLM's extra_keys made hashable (lists become tuples), bounded in items."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise KvEventError("kv events: extra_keys is not a list")
    return tuple(_frozen(item, budget, 0) for item in v)


def _frozen(v: object, budget: _Budget, depth: int) -> Any:
    budget.take("extra", 1)
    if v is None or type(v) in (int, float, bool):
        return v
    if type(v) in (str, bytes):
        if len(v) > MAX_STR:  # type: ignore[arg-type]
            raise KvEventError("kv events: a string in extra_keys is too long")
        return v
    if isinstance(v, list) and depth < 4:
        return tuple(_frozen(x, budget, depth + 1) for x in v)
    raise KvEventError("kv events: extra_keys holds something other than plain values")

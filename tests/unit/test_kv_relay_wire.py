"""The agent-to-router KV relay's frames: every message round-trips, a batch through the
one engine-event decoder, and any frames decode to a message or a typed error."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kvcache_events import _removed_st, _stored_st

from llmgw.kvcache.events import Batch, Cleared, KvEventError
from llmgw.kvcache.relay_wire import (
    PROTO,
    Follow,
    Gone,
    Life,
    RelayBatch,
    RelayError,
    decode,
    encode,
)

_replica = st.text(min_size=1, max_size=20).filter(lambda s: len(s.encode()) <= 1024)
_salted = _stored_st.map(lambda s: type(s)(**{**{a: getattr(s, a) for a in (
    "block_hashes", "parent", "token_ids", "block_size", "lora_name", "lora_id", "medium",
    "group")}, "cache_salt": "salt", "extra_keys": (None, ("lora", ((b"mm", 3),)))}))
_batch = st.builds(
    Batch, ts=st.floats(allow_nan=False), seq=st.just(0), dp_rank=st.none() | st.integers(0, 7),
    events=st.lists(st.one_of(_stored_st, _salted, _removed_st, st.just(Cleared())),
                    max_size=5).map(tuple))
_life = st.integers(0, (1 << 63) - 1)
_seq = st.integers(0, (1 << 64) - 1)
_message = st.one_of(
    st.builds(Follow, st.dictionaries(_replica, st.none() | st.tuples(_life, _seq), max_size=5)),
    st.builds(Life, _replica, _life, _seq),
    st.builds(Gone, _replica),
    st.builds(lambda r, life, seq, b: RelayBatch(r, life, seq, Batch(b.ts, seq, b.dp_rank, b.events)),
              _replica, _life, _seq, _batch),
)


@settings(max_examples=1000, deadline=None, database=None)
@given(_message)
def test_every_message_round_trips(msg: Any) -> None:
    assert decode(encode(msg)) == msg


def test_a_batch_travels_in_vllms_map_encoding_with_its_required_fields() -> None:
    import msgpack

    from llmgw.kvcache.events import Removed, Stored
    b = Batch(1.0, 5, 0, (Stored((1, 2), None, tuple(range(8)), 4), Removed((9,)), Cleared()))
    frames = encode(RelayBatch("r-1", 7, 5, b))
    assert frames[:5] == [PROTO, b"batch", b"r-1", (7).to_bytes(8, "big"), (5).to_bytes(8, "big")]
    assert msgpack.unpackb(frames[5]) == [1.0, [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
         "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": None,
         "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [9], "medium": None},
        {"type": "AllBlocksCleared"}], 0]


@pytest.mark.parametrize("frames", [
    [], [PROTO], [b"other/1", b"gone", b"r"], [PROTO, b"gone", b""], [PROTO, b"gone", b"\xff"],
    [PROTO, b"life", b"r", b"\x00" * 8], [PROTO, b"life", b"r", b"\x80" + b"\x00" * 7, b"\x00" * 8],
    [PROTO, b"life", b"r", b"\x00" * 7, b"\x00" * 8], [PROTO, b"follow", b"\xc1"],
    [PROTO, b"follow", b"\x91\x01"], [PROTO, b"follow", b"\x81\xa1r\x92\x01\xff"],
    [PROTO, b"batch", b"r", b"\x00" * 8, b"\x00" * 8, b"\x90"], [PROTO, b"what", b"r"],
])
def test_bad_frames_are_typed_errors(frames: list[bytes]) -> None:
    with pytest.raises(KvEventError):
        decode(frames)


@settings(max_examples=3000, deadline=None, database=None)
@given(st.lists(st.binary(max_size=40), max_size=7), st.booleans(), st.sampled_from(
    [b"follow", b"life", b"batch", b"gone", b"x"]))
def test_arbitrary_frames(frames: list[bytes], proto: bool, kind: bytes) -> None:
    if proto:
        frames = [PROTO, kind, *frames]
    try:
        decode(frames)
    except (RelayError, KvEventError):
        pass  # a typed error is the other allowed answer


@settings(max_examples=2000, deadline=None, database=None)
@given(_message, st.data())
def test_mutated_messages(msg: Any, data: st.DataObject) -> None:
    frames = [bytearray(f) for f in encode(msg)]
    for _ in range(data.draw(st.integers(1, 3))):
        f = frames[data.draw(st.integers(0, len(frames) - 1))]
        if f:
            f[data.draw(st.integers(0, len(f) - 1))] = data.draw(st.integers(0, 255))
    try:
        decode([bytes(f) for f in frames])
    except (RelayError, KvEventError):
        pass  # a typed error is the other allowed answer

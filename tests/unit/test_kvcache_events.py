"""The KV-event decoder: both encodings of vLLM's events (tagged maps since vLLM PR 42892,
tagged arrays before), SGLang's shapes, and fuzzing with arbitrary bytes and with
mutations of valid payloads: a Batch or a KvEventError, never anything else."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.errors import ProtocolError
from llmgw.kvcache import events
from llmgw.kvcache.events import (
    END_SEQ,
    Batch,
    Cleared,
    KvEventError,
    Removed,
    Stored,
    decode_batch,
    is_replay_end,
    replay_frames,
    replay_request,
)

SEQ7 = (7).to_bytes(8, "big")


def _stored_map(**over: Any) -> dict[str, Any]:
    # What vLLM 0.32's encoder writes for a BlockStored (kv_events.py:56-94, omit_defaults).
    m: dict[str, Any] = {"type": "BlockStored", "block_hashes": [11, b"\x01" * 32],
                         "parent_block_hash": None, "token_ids": [1, 2, 3, 4], "block_size": 2,
                         "lora_id": None, "medium": "GPU", "lora_name": None}
    m.update(over)
    return m


def _pack(*evs: Any, ts: float = 1.5, rank: int | None = 0) -> bytes:
    return msgpack.packb([ts, list(evs), rank], use_bin_type=True)


def test_map_encoding_of_every_event_kind() -> None:
    payload = _pack(
        _stored_map(extra_keys=[None, ["a", ["mm", 3]]], group_idx=1, session_id="s",
                    kv_cache_spec_kind="full", unheard_of={"x": 1}),
        {"type": "BlockRemoved", "block_hashes": [11], "medium": None, "group_idx": 1,
         "locality": "LOCAL"},
        {"type": "AllBlocksCleared"},
    )
    b = decode_batch(b"", SEQ7, payload)
    assert b == Batch(ts=1.5, seq=7, dp_rank=0, events=(
        Stored(block_hashes=(11, b"\x01" * 32), parent=None, token_ids=(1, 2, 3, 4),
               block_size=2, medium="GPU", group=1, extra_keys=(None, ("a", ("mm", 3)))),
        Removed(block_hashes=(11,), group=1),
        Cleared(),
    ))


def test_array_encoding_before_maps_with_trailing_items_and_missing_optionals() -> None:
    oldest = ["BlockStored", [5], 4, [9, 9], 2, None]  # vLLM's first shape: up to lora_id
    newer = ["BlockStored", [6], 5, [8, 8], 2, 3, "CPU", "ad", [["ad"]], 0, "full", 128,
             "more", "to", "come"]
    payload = _pack(oldest, newer, ["BlockRemoved", [5]], ["BlockRemoved", [6], "CPU", 0, "x"],
                    ["AllBlocksCleared"], rank=None)
    b = decode_batch(b"topic", SEQ7, payload)
    assert b.dp_rank is None
    assert b.events == (
        Stored(block_hashes=(5,), parent=4, token_ids=(9, 9), block_size=2),
        Stored(block_hashes=(6,), parent=5, token_ids=(8, 8), block_size=2, lora_id=3,
               medium="CPU", lora_name="ad", group=0, extra_keys=(("ad",),)),
        Removed(block_hashes=(5,)),
        Removed(block_hashes=(6,), medium="CPU", group=0),
        Cleared(),
    )


def test_sglang_shapes() -> None:
    # SGLang's array BlockStored with its metadata map where vLLM has lora_name, its
    # two-item batch, and its newer map shape with cache_salt as a key.
    salted = ["BlockStored", [1], None, [4, 4], 2, None, "GPU", {"cache_salt": "t"}]
    mapped = {"type": "BlockStored", "block_hashes": [2], "parent_block_hash": 1,
              "token_ids": [5, 5], "block_size": 2, "lora_id": None, "medium": "CPU_PINNED",
              "cache_salt": "u", "session_id": "s"}
    b = decode_batch(b"", SEQ7, msgpack.packb([2.0, [salted, mapped]]))
    assert b.dp_rank is None
    assert b.events[0] == Stored(block_hashes=(1,), parent=None, token_ids=(4, 4),
                                 block_size=2, medium="GPU", cache_salt="t")
    assert b.events[1] == Stored(block_hashes=(2,), parent=1, token_ids=(5, 5),
                                 block_size=2, medium="CPU_PINNED", cache_salt="u")


def test_batch_as_a_map_and_int_ts() -> None:
    raw = {"ts": 3, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 2}
    b = decode_batch(b"", SEQ7, msgpack.packb(raw))
    assert (b.ts, b.dp_rank, b.events) == (3.0, 2, (Cleared(),))


@pytest.mark.parametrize("payload", [
    b"",
    b"\xc1",
    msgpack.packb([1.0]),
    msgpack.packb([True, []]),
    msgpack.packb([1.0, {}]),
    msgpack.packb([1.0, [], "rank"]),
    msgpack.packb([1.0, [{"type": "BlockMoved"}]]),
    msgpack.packb([1.0, [[]]]),
    msgpack.packb([1.0, [7]]),
    msgpack.packb([1.0, [_stored_map(token_ids=[1, True])]]),
    msgpack.packb([1.0, [_stored_map(token_ids=[1 << 63])]]),
    msgpack.packb([1.0, [_stored_map(block_size=0)]]),
    msgpack.packb([1.0, [_stored_map(block_hashes=[1.5])]]),
    msgpack.packb([1.0, [_stored_map(block_hashes=[b""])]]),
    msgpack.packb([1.0, [_stored_map(lora_name=7)]]),
    msgpack.packb([1.0, [_stored_map(extra_keys=[{"a": 1}])]]),
    msgpack.packb([1.0, [{"type": "BlockRemoved"}]]),
    msgpack.packb([1.0, []]) + b"\x00",  # trailing bytes
    msgpack.packb(msgpack.ExtType(1, b"x")),
])
def test_bad_payloads_are_typed_errors(payload: bytes) -> None:
    with pytest.raises(KvEventError):
        decode_batch(b"", SEQ7, payload)


def test_bad_frames_are_typed_errors() -> None:
    ok = _pack()
    with pytest.raises(KvEventError):
        decode_batch(b"", b"\x00" * 7, ok)
    with pytest.raises(KvEventError):
        decode_batch(b"t" * (events.MAX_TOPIC + 1), SEQ7, ok)
    assert issubclass(KvEventError, ProtocolError)


def test_bounds_refuse_over_long_batches() -> None:
    per = events.MAX_TOKENS // 4 + 1
    big = _stored_map(token_ids=[1] * per, block_size=1, block_hashes=[1])
    with pytest.raises(KvEventError, match="tokens"):
        decode_batch(b"", SEQ7, _pack(big, big, big, big))
    assert decode_batch(b"", SEQ7, _pack(big, big, big)).events[0].block_size == 1  # type: ignore[union-attr]


def test_replay_protocol() -> None:
    assert replay_request(0) == b"\x00" * 8
    assert replay_request(258) == b"\x00" * 6 + b"\x01\x02"
    with pytest.raises(ValueError):
        replay_request(-1)
    assert is_replay_end((-1).to_bytes(8, "big", signed=True)) and END_SEQ == b"\xff" * 8
    assert not is_replay_end(SEQ7)
    # vLLM 0.32 sends the topic in replay answers; earlier vLLM and SGLang did not.
    assert replay_frames([b"", b"tp", SEQ7, b"p"]) == (b"tp", SEQ7, b"p")
    assert replay_frames([b"", SEQ7, b"p"]) == (b"", SEQ7, b"p")
    assert replay_frames([b"", b"", END_SEQ, b""]) == (b"", END_SEQ, b"")
    with pytest.raises(KvEventError):
        replay_frames([b"", b"x"])


# -- fuzzing -------------------------------------------------------------------------

def _decode_or_typed_error(topic: bytes, seq: bytes, payload: bytes) -> None:
    try:
        b = decode_batch(topic, seq, payload)
    except KvEventError:
        return
    assert isinstance(b, Batch)
    hash(b)  # every value in it is hashable: usable as opaque keys


@settings(max_examples=3000, deadline=None, database=None)
@given(st.binary(max_size=8), st.binary(max_size=400))
def test_arbitrary_bytes(seq: bytes, payload: bytes) -> None:
    _decode_or_typed_error(b"", seq, payload)


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
                     st.floats(allow_nan=True), st.text(max_size=8), st.binary(max_size=40))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=12)


def _valid_events() -> list[Any]:
    return [
        _stored_map(extra_keys=[None, ["a"]], group_idx=0),
        {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
        ["BlockStored", [5], 4, [9, 9], 2, None, "GPU", "ad", None, 0],
        ["BlockStored", [1], None, [4, 4], 2, None, "GPU", {"cache_salt": "t"}],
        ["BlockRemoved", [5], "GPU"],
        ["AllBlocksCleared"],
    ]


def _mutate(obj: Any, data: st.DataObject) -> Any:
    """One random change somewhere inside `obj`: a value replaced, an item dropped or
    appended, a key added."""
    if isinstance(obj, list) and obj and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(obj) - 1))
        obj = list(obj)
        how = data.draw(st.sampled_from(["deeper", "replace", "drop", "append"]))
        if how == "deeper":
            obj[i] = _mutate(obj[i], data)
        elif how == "replace":
            obj[i] = data.draw(_values)
        elif how == "drop":
            del obj[i]
        else:
            obj.append(data.draw(_values))
        return obj
    if isinstance(obj, dict) and obj and data.draw(st.booleans()):
        obj = dict(obj)
        k = data.draw(st.sampled_from(sorted(obj)))
        how = data.draw(st.sampled_from(["deeper", "replace", "drop", "add"]))
        if how == "deeper":
            obj[k] = _mutate(obj[k], data)
        elif how == "replace":
            obj[k] = data.draw(_values)
        elif how == "drop":
            del obj[k]
        else:
            obj[data.draw(st.text(max_size=12))] = data.draw(_values)
        return obj
    return data.draw(_values)


@settings(max_examples=3000, deadline=None, database=None)
@given(st.data())
def test_mutated_valid_batches_in_both_encodings(data: st.DataObject) -> None:
    batch = [1.5, _valid_events(), 0]
    for _ in range(data.draw(st.integers(1, 3))):
        batch = _mutate(batch, data)
    payload = msgpack.packb(batch, use_bin_type=True)
    _decode_or_typed_error(b"", SEQ7, payload)


@settings(max_examples=1000, deadline=None, database=None)
@given(st.data())
def test_mutated_bytes_of_a_valid_batch(data: st.DataObject) -> None:
    payload = bytearray(_pack(*_valid_events()))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] = data.draw(st.integers(0, 255))
    _decode_or_typed_error(b"", SEQ7, bytes(payload))


_hash_st = st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.binary(min_size=1, max_size=32))
_opt_str = st.none() | st.text(max_size=10)
_stored_st = st.builds(
    Stored,
    block_hashes=st.lists(_hash_st, max_size=4).map(tuple),
    parent=st.none() | _hash_st,
    token_ids=st.lists(st.integers(0, 1 << 40), max_size=8).map(tuple),
    block_size=st.integers(1, 64),
    lora_name=_opt_str,
    lora_id=st.none() | st.integers(0, 100),
    medium=_opt_str,
    group=st.none() | st.integers(0, 3),
)
_removed_st = st.builds(Removed, block_hashes=st.lists(_hash_st, max_size=4).map(tuple),
                        medium=_opt_str, group=st.none() | st.integers(0, 3))


def _as_map(e: Any) -> dict[str, Any]:
    if isinstance(e, Stored):
        return {"type": "BlockStored", "block_hashes": list(e.block_hashes),
                "parent_block_hash": e.parent, "token_ids": list(e.token_ids),
                "block_size": e.block_size, "lora_id": e.lora_id, "medium": e.medium,
                "lora_name": e.lora_name, "group_idx": e.group}
    if isinstance(e, Removed):
        return {"type": "BlockRemoved", "block_hashes": list(e.block_hashes),
                "medium": e.medium, "group_idx": e.group}
    return {"type": "AllBlocksCleared"}


def _as_array(e: Any) -> list[Any]:
    if isinstance(e, Stored):
        return ["BlockStored", list(e.block_hashes), e.parent, list(e.token_ids), e.block_size,
                e.lora_id, e.medium, e.lora_name, None, e.group]
    if isinstance(e, Removed):
        return ["BlockRemoved", list(e.block_hashes), e.medium, e.group]
    return ["AllBlocksCleared"]


@settings(max_examples=500, deadline=None, database=None)
@given(st.lists(st.one_of(_stored_st, _removed_st, st.just(Cleared())), max_size=5),
       st.floats(allow_nan=False), st.none() | st.integers(0, 7), st.integers(0, (1 << 64) - 1),
       st.booleans())
def test_round_trip(evs: list[Any], ts: float, rank: int | None, seq: int, as_map: bool) -> None:
    enc = _as_map if as_map else _as_array
    payload = msgpack.packb([ts, [enc(e) for e in evs], rank], use_bin_type=True)
    b = decode_batch(b"", seq.to_bytes(8, "big"), payload)
    assert b == Batch(ts=ts, seq=seq, dp_rank=rank, events=tuple(evs))

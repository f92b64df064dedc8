"""llmgw's KV-event decoder reads what the installed vLLM itself sends: batches published by
vLLM's own ZmqEventPublisher and given back by its replay socket, batches through msgspec's
encoder as the publisher uses it, and the tagged-array encoding of the events from before
vLLM PR 42892 (vLLM's own field lists declared array_like). Every event kind, with and
without its optional fields (kv_events_encode.py, run with the vLLM venv's python)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from llmgw.kvcache import blocks
from llmgw.kvcache.events import (
    Batch,
    Cleared,
    Removed,
    Stored,
    decode_batch,
    is_replay_end,
    replay_frames,
)
from llmgw.kvcache.index import KvIndex
from llmgw.kvcache.relay_wire import encode_batch

pytestmark = pytest.mark.real_engine
HERE = Path(__file__).resolve().parent
H32 = b"\x01" * 32
P32 = b"\x02" * 32

EVENTS = (
    Stored(block_hashes=(123, H32), parent=P32, token_ids=tuple(range(1, 9)), block_size=4,
           lora_name="ad", lora_id=3, medium="GPU", group=1,
           extra_keys=(("ad",), ("ad", ("img", 4), "salt"))),
    Stored(block_hashes=(7,), parent=None, token_ids=(1, 2, 3, 4), block_size=4),
    Removed(block_hashes=(123, H32), medium="GPU", group=1),
    Removed(block_hashes=(7,)),
    Cleared(),
)


@pytest.fixture(scope="module")
def encoded(vllm_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list[bytes]]]:
    folder = tmp_path_factory.mktemp("kv")
    r = subprocess.run([str(vllm_venv / "bin" / "python"), str(HERE / "kv_events_encode.py"), str(folder)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    raw = json.loads(r.stdout.strip().splitlines()[-1])
    return {case: [[bytes.fromhex(f) for f in msg] for msg in msgs] for case, msgs in raw.items()}


def test_what_vllms_publisher_sends_and_replays(encoded: dict[str, list[list[bytes]]]) -> None:
    msgs = [replay_frames(m) for m in encoded["publisher"]]
    topic, end, last = msgs[-1]
    assert is_replay_end(end) and last == b""
    batches = [decode_batch(*m) for m in msgs[:-1]]
    assert [m[0] for m in msgs[:-1]] == [b"kv", b"kv"]  # vLLM 0.32 replays the topic too
    # seq counts from 0; the publisher fills in its data-parallel rank.
    assert batches == [Batch(ts=1.25, seq=0, dp_rank=0, events=EVENTS),
                       Batch(ts=2.5, seq=1, dp_rank=0, events=(Cleared(),))]


def test_what_vllms_encoder_writes_without_a_rank(encoded: dict[str, list[list[bytes]]]) -> None:
    [m] = encoded["encoder"]
    assert decode_batch(m[0], m[1], m[2]) == Batch(ts=1.25, seq=9, dp_rank=None, events=EVENTS)


def test_the_array_encoding_from_before_maps(encoded: dict[str, list[list[bytes]]]) -> None:
    [m] = encoded["arrays"]
    assert decode_batch(m[0], m[1], m[2]) == Batch(ts=1.25, seq=5, dp_rank=3, events=EVENTS)


def test_the_index_follows_vllms_events(encoded: dict[str, list[list[bytes]]]) -> None:
    [m] = encoded["encoder"]
    events = decode_batch(m[0], m[1], m[2]).events
    ix = KvIndex("m", max_blocks=100)
    keys = blocks.chain_keys([1, 2, 3, 4], 4, ix.seed(None))
    out = ix.apply_events("r", events[:2])
    # The first store's parent was never seen: its two blocks are orphans, not guesses.
    assert (out.stored, out.orphans) == (1, 2)
    assert ix.match(keys, 0.0) == {"r": 1}
    ix.apply_events("r", events[2:4])
    assert ix.match(keys, 0.0) == {}


def test_the_relay_writes_what_vllms_own_decoder_reads(vllm_venv: Path) -> None:
    """An agent relays batches to routers in vLLM's current encoding (relay_wire.py): vLLM's
    own KVEventBatch decoder reads one back, every field llmgw keeps as it was."""
    import base64

    payload = encode_batch(Batch(ts=1.25, seq=0, dp_rank=2, events=EVENTS))
    r = subprocess.run([str(vllm_venv / "bin" / "python"), str(HERE / "kv_events_encode.py"),
                        "--decode", payload.hex()], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    ts, events, rank = json.loads(r.stdout.strip().splitlines()[-1])  # EventBatch is array_like
    assert (ts, rank) == (1.25, 2)

    def h(v: object) -> object:  # msgspec writes bytes as base64 in builtins
        return base64.b64decode(v) if isinstance(v, str) else v

    s, s2, rm, rm2, _ = events
    assert [e["type"] for e in events] == [
        "BlockStored", "BlockStored", "BlockRemoved", "BlockRemoved", "AllBlocksCleared"]
    assert [h(x) for x in s["block_hashes"]] == [123, H32] and h(s["parent_block_hash"]) == P32
    assert (s["token_ids"], s["block_size"], s["lora_id"], s["medium"], s["lora_name"],
            s["group_idx"]) == (list(range(1, 9)), 4, 3, "GPU", "ad", 1)
    assert s["extra_keys"] == [["ad"], ["ad", ["img", 4], "salt"]]
    assert (s2["block_hashes"], s2["parent_block_hash"], s2["lora_name"]) == ([7], None, None)
    assert "extra_keys" not in s2  # its default (omit_defaults in vLLM's struct)
    assert ([h(x) for x in rm["block_hashes"]], rm["medium"], rm["group_idx"]) == ([123, H32], "GPU", 1)
    assert (rm2["block_hashes"], rm2["medium"]) == ([7], None)

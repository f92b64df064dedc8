"""KV-cache event batches as the installed vLLM itself encodes them.

Run with the vLLM venv's python, with a scratch folder as its argument. Prints a JSON map
from case name to a list of messages, each the hex of its frames `[topic, seq, payload]`:

- "publisher": vLLM's own ZmqEventPublisher (ipc sockets in the folder) publishes the
  batches, and its replay socket, asked from seq 0 as a subscriber asks, gives them back:
  the frames exactly as vLLM sends them, seq and data-parallel rank filled in by vLLM.
- "encoder": the same events in a batch without a rank, through msgspec's encoder as the
  publisher thread uses it (vllm/distributed/kv_events.py `_publisher_thread`).
- "arrays": the same events with vLLM's own field lists, declared `array_like` as the event
  structs were before vLLM PR 42892: the encoding older engines send.

With `--decode HEX` instead: HEX is a payload (llmgw's relay writes one), decoded by vLLM's
own `KVEventBatch` decoder as a subscriber of vLLM's publisher decodes it; printed as JSON
(msgspec's builtins, bytes as base64).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

H32 = b"\x01" * 32
P32 = b"\x02" * 32


def _events() -> list[Any]:
    return [
        BlockStored(block_hashes=[123, H32], parent_block_hash=P32, token_ids=list(range(1, 9)),
                    block_size=4, lora_id=3, medium="GPU", lora_name="ad",
                    extra_keys=[("ad",), ("ad", ("img", 4), "salt")], group_idx=1,
                    kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=128,
                    locality="LOCAL", ownership="tier2", session_id="s1"),
        BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                    block_size=4, lora_id=None, medium=None, lora_name=None),
        BlockRemoved(block_hashes=[123, H32], medium="GPU", group_idx=1, locality="LOCAL",
                     ownership="tier2"),
        BlockRemoved(block_hashes=[7], medium=None),
        AllBlocksCleared(),
    ]


def _hex(frames: list[bytes]) -> list[str]:
    return [f.hex() for f in frames]


def _publisher(folder: str) -> list[list[str]]:
    pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=f"ipc://{folder}/pub",
                            replay_endpoint=f"ipc://{folder}/replay", topic="kv")
    pub.publish(KVEventBatch(ts=1.25, events=_events()))
    pub.publish(KVEventBatch(ts=2.5, events=[AllBlocksCleared()]))
    deadline = time.monotonic() + 30
    while len(pub._buffer) < 2:  # the publisher thread has sent both
        if time.monotonic() > deadline:
            raise SystemExit("the publisher did not send its batches")
        time.sleep(0.01)
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"ipc://{folder}/replay")
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    out = []
    while True:
        if not sock.poll(30_000):
            raise SystemExit("no replay answer")
        frames = sock.recv_multipart()
        out.append(_hex(frames))
        if frames[-2] == ZmqEventPublisher.END_SEQ:
            break
    sock.close(linger=0)
    pub.shutdown()
    return out


def _legacy(cls: type) -> type:
    """`cls` with its own fields, in its own order, encoded as a tagged array."""
    fields: list[tuple[Any, ...]] = []
    for f in msgspec.structs.fields(cls):
        if f.required:
            fields.append((f.name, f.type))
        else:
            fields.append((f.name, f.type, f.default))
    return msgspec.defstruct(cls.__name__, fields, array_like=True, omit_defaults=True,
                             tag=cls.__name__)


def _arrays() -> list[list[str]]:
    batch_cls = msgspec.defstruct("EventBatch", [("ts", float), ("events", list),
                                                 ("data_parallel_rank", int | None, None)],
                                  array_like=True, omit_defaults=True)
    legacy = {c.__name__: _legacy(c) for c in (BlockStored, BlockRemoved, AllBlocksCleared)}
    evs = [legacy[type(e).__name__](**msgspec.structs.asdict(e)) for e in _events()]
    payload = msgspec.msgpack.Encoder().encode(batch_cls(ts=1.25, events=evs, data_parallel_rank=3))
    return [_hex([b"", (5).to_bytes(8, "big"), payload])]


def main() -> None:
    if sys.argv[1] == "--decode":
        batch = msgspec.msgpack.Decoder(KVEventBatch).decode(bytes.fromhex(sys.argv[2]))
        print(json.dumps(msgspec.to_builtins(batch)))
        return
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.25, events=_events()))
    print(json.dumps({
        "publisher": _publisher(sys.argv[1]),
        "encoder": [_hex([b"", (9).to_bytes(8, "big"), payload])],
        "arrays": _arrays(),
    }))


if __name__ == "__main__":
    main()

"""Bytes per block of the KV-cache index (llmgw.kvcache.index), measured with tracemalloc.

    .venv/bin/python bench/kv_index_memory.py [--blocks 200000] [--hash int|bytes]

Fills one replica's index with `--blocks` stored blocks, chained 16 blocks to a store
event as a long prefill makes them, with block hashes as vLLM sends them (64-bit ints, or
32-byte sha256 digests), and prints the traced bytes the index holds per block (the
engine-block entry with the engine's hash object, its router key and the key's reference
count). Tracing starts before the events are built; they are dropped before the count, so
what stays is what the index keeps.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import tracemalloc

from llmgw.kvcache.events import Stored
from llmgw.kvcache.index import KvIndex

BLOCK = 16
PER_EVENT = 16


def _events(n_blocks: int, as_bytes: bool) -> list[Stored]:
    out: list[Stored] = []
    parent: int | bytes | None = None
    for e in range(n_blocks // PER_EVENT):
        hashes: list[int | bytes] = []
        for i in range(PER_EVENT):
            d = hashlib.sha256(f"{e}/{i}".encode()).digest()
            hashes.append(d if as_bytes else int.from_bytes(d[:8], "big"))
        toks = tuple(range(e * PER_EVENT * BLOCK, (e + 1) * PER_EVENT * BLOCK))
        out.append(Stored(block_hashes=tuple(hashes), parent=parent, token_ids=toks, block_size=BLOCK))
        parent = hashes[-1]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=200_000)
    ap.add_argument("--hash", choices=["int", "bytes"], default="int")
    a = ap.parse_args()
    ix = KvIndex("model", max_blocks=a.blocks)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    evs = _events(a.blocks, a.hash == "bytes")
    ix.apply_events("replica-0", evs)
    del evs
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    n = ix.size("replica-0")
    print(f"{n} blocks ({a.hash} hashes): {(after - before) / n:.0f} bytes per block, "
          f"{(after - before) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()

"""The router's own block keys, chained from token ids.

key_0 = H(seed, tokens of block 0), key_i = H(key_{i-1}, tokens of block i), with the
seed drawn from the model and the LoRA adapter. The engine's events carry each block's
token ids and its parent, so the index chains the same keys from them as the router does
from a request's tokens: the engine's hash function and seed (vLLM's PYTHONHASHSEED, sha256
or not) need not be known or match. Only the block size must, and it is read from the
engine's events (`Stored.block_size`).

H is blake2b with an 8-byte digest over the parent key and the tokens packed as
little-endian int64: fast, in the standard library, and the same on every run and host.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

ROOT = 0  # the "parent" of a first block, beside the seed


def seed(model: str, lora_name: str | None) -> int:
    """The chain's seed for one model and adapter (None: the base model)."""
    text = f"{model}\x00{lora_name or ''}".encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8, person=b"llmgw-kv").digest(), "little")


def _packed(tokens: Sequence[int]) -> bytes:
    a = array("q", tokens)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def chain(parent: int, seed_: int, tokens: Sequence[int]) -> int:
    """The key of one block whose predecessor's key is `parent` (ROOT for the first)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little"))
    h.update(seed_.to_bytes(8, "little"))
    h.update(_packed(tokens))
    return int.from_bytes(h.digest(), "little")


def chain_keys(tokens: Sequence[int], block_size: int, seed_: int, parent: int = ROOT) -> list[int]:
    """Keys of the full blocks of `tokens` (a partial last block has none: engines cache
    full blocks only), starting after the block whose key is `parent`."""
    if block_size <= 0:
        raise ValueError(f"block size {block_size} is not positive")
    keys: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain(parent, seed_, tokens[start : start + block_size])
        keys.append(parent)
    return keys

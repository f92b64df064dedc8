"""Which blocks each replica of one model holds, as the router's own keys, bounded.

Per replica the index keeps what the engine's events said: engine block (medium, group,
engine hash) -> router key (`blocks.chain` over the block's token ids, chained from its
parent's router key). A stored block whose parent the index does not know (its store was
lost, evicted from the index, or came before a clear) cannot be placed in the chain and is
counted as an orphan, never guessed; so are blocks whose token ids do not line up with
their hashes (vLLM leaves null sliding-window blocks out of `block_hashes` but not of
`token_ids`) and blocks whose hash took in more than the tokens and the adapter (vLLM's
`extra_keys` with multimodal ids, a cache salt or prompt embeddings; SGLang's
`cache_salt`): a request's tokens alone would match them falsely. A child of a block that
was not placed is an orphan in turn.

A router key counts as cached on a replica while at least one engine block maps to it
(hybrid models store the same prefix once per KV-cache group). A query asks for the
longest run of a request's leading keys that each replica holds, counting also the
speculative entries: keys the router added for the replica it just chose, until
`now + ttl`, so a burst of one prefix follows the first choice before the engine's events
come back.

Memory is bounded per replica: at most `max_blocks` engine blocks (the least recently
stored or re-announced go first; vLLM announces reused prefix blocks again:
vllm/v1/core/block_pool.py:546, `emit_cached_block_events`) and at most `max_blocks`
speculative keys. About 300 bytes per block (bench/kv_index_memory.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import attrs

from llmgw.kvcache import blocks
from llmgw.kvcache.events import Batch, BlockHash, Cleared, Event, Removed, Stored

EngineBlock = tuple[str | None, int | None, BlockHash]  # (medium, group, engine hash)


@attrs.define
class Applied:
    """What applying events did, for metrics."""

    stored: int = 0
    removed: int = 0
    orphans: int = 0  # blocks that could not be placed in the chain
    cleared: int = 0
    evicted: int = 0  # blocks dropped to keep the bound


class _Replica:
    __slots__ = ("blocks", "refs", "spec", "block_size")

    def __init__(self) -> None:
        self.blocks: OrderedDict[EngineBlock, int] = OrderedDict()  # oldest first
        self.refs: dict[int, int] = {}  # router key -> engine blocks mapping to it
        self.spec: OrderedDict[int, float] = OrderedDict()  # router key -> expiry
        self.block_size: int | None = None


class KvIndex:
    """The blocks of one model's replicas. Replicas are named by the caller's ids."""

    def __init__(self, model: str, max_blocks: int) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks {max_blocks} is not positive")
        self.model = model
        self.max_blocks = max_blocks
        self._replicas: dict[str, _Replica] = {}
        self._seeds: dict[str | None, int] = {}

    # -- keys ------------------------------------------------------------------------
    def seed(self, lora_name: str | None) -> int:
        s = self._seeds.get(lora_name)
        if s is None:
            s = blocks.seed(self.model, lora_name)
            if len(self._seeds) < 4096:  # adapters are few; the cache stays small anyway
                self._seeds[lora_name] = s
        return s

    def block_size(self) -> int | None:
        """The block size the engines' events reported (the first replica's that did)."""
        for r in self._replicas.values():
            if r.block_size is not None:
                return r.block_size
        return None

    # -- events ----------------------------------------------------------------------
    def apply(self, replica: str, batch: Batch) -> Applied:
        return self.apply_events(replica, batch.events)

    def apply_events(self, replica: str, events: Iterable[Event]) -> Applied:
        out = Applied()
        r = self._replicas.get(replica)
        if r is None:
            r = self._replicas[replica] = _Replica()
        for e in events:
            if isinstance(e, Stored):
                self._store(r, e, out)
            elif isinstance(e, Removed):
                for h in e.block_hashes:
                    if self._drop(r, (e.medium, e.group, h)):
                        out.removed += 1
            elif isinstance(e, Cleared):
                out.cleared += len(r.blocks)
                r.blocks.clear()
                r.refs.clear()
                r.spec.clear()
        return out

    def clear(self, replica: str) -> None:
        """Forget a replica: its engine restarted or stopped, or its stream had a gap."""
        self._replicas.pop(replica, None)

    def _store(self, r: _Replica, e: Stored, out: Applied) -> None:
        n = len(e.block_hashes)
        size = e.block_size
        if r.block_size is None:
            r.block_size = size
        parent = blocks.ROOT
        if e.parent is not None:
            found = r.blocks.get((e.medium, e.group, e.parent))
            if found is None:
                out.orphans += n
                return
            parent = found
        if len(e.token_ids) != n * size or e.cache_salt is not None:
            out.orphans += n
            return
        seed = self.seed(e.lora_name)
        extra = e.extra_keys
        for i, h in enumerate(e.block_hashes):
            if extra is not None and i < len(extra) and not _only_lora(extra[i], e.lora_name):
                out.orphans += n - i
                return
            parent = blocks.chain(parent, seed, e.token_ids[i * size : (i + 1) * size])
            self._put(r, (e.medium, e.group, h), parent, out)
            out.stored += 1

    def _put(self, r: _Replica, block: EngineBlock, key: int, out: Applied) -> None:
        old = r.blocks.get(block)
        if old is not None:
            r.blocks.move_to_end(block)
            if old == key:
                return
            self._unref(r, old)
        r.blocks[block] = key
        r.refs[key] = r.refs.get(key, 0) + 1
        while len(r.blocks) > self.max_blocks:
            _, k = r.blocks.popitem(last=False)
            self._unref(r, k)
            out.evicted += 1

    def _drop(self, r: _Replica, block: EngineBlock) -> bool:
        key = r.blocks.pop(block, None)
        if key is None:
            return False
        self._unref(r, key)
        return True

    @staticmethod
    def _unref(r: _Replica, key: int) -> None:
        left = r.refs.get(key, 0) - 1
        if left > 0:
            r.refs[key] = left
        else:
            r.refs.pop(key, None)

    # -- queries ---------------------------------------------------------------------
    def match(self, keys: Sequence[int], now: float) -> dict[str, int]:
        """Per replica the index knows, how many of `keys` (a request's chained keys,
        first block first) it holds in a run from the start. Replicas with none are
        left out."""
        out: dict[str, int] = {}
        for name, r in self._replicas.items():
            n = 0
            refs, spec = r.refs, r.spec
            for k in keys:
                if k in refs:
                    n += 1
                    continue
                until = spec.get(k)
                if until is None or until <= now:
                    break
                n += 1
            if n:
                out[name] = n
        return out

    def speculate(self, replica: str, keys: Sequence[int], now: float, ttl: float) -> None:
        """Count `keys` as held by `replica` until now + ttl (the router just sent it a
        request with them): the next requests of a burst then follow it."""
        r = self._replicas.get(replica)
        if r is None:
            r = self._replicas[replica] = _Replica()
        spec = r.spec
        # Expired entries sit at the front: every entry is (re)inserted at the back.
        while spec:
            k, until = next(iter(spec.items()))
            if until > now:
                break
            del spec[k]
        until = now + ttl
        for k in keys:
            spec[k] = until
            spec.move_to_end(k)
        while len(spec) > self.max_blocks:
            spec.popitem(last=False)

    # -- sizes -----------------------------------------------------------------------
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def size(self, replica: str) -> int:
        r = self._replicas.get(replica)
        return len(r.blocks) if r is not None else 0

    def speculative_size(self, replica: str) -> int:
        r = self._replicas.get(replica)
        return len(r.spec) if r is not None else 0


def _only_lora(entry: object, lora_name: str | None) -> bool:
    """True when a block's extra keys are none, or just its LoRA name (which the seed
    already takes in): vLLM puts the name first when the request has an adapter
    (kv_events.py:70-76)."""
    return entry is None or entry == () or (lora_name is not None and entry == (lora_name,))

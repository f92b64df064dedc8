"""The kv_aware policy: a request goes to the replica whose engine holds the most of its
prompt's leading KV-cache blocks, weighed against that replica's load.

Per kv_aware model, loaded once at start: the model's tokenizer (kvcache/tokenize.py, the
ids vLLM makes) and a bounded index of the blocks each replica holds (kvcache/index.py),
which the agents' relays fill (links.py). Per request: the prompt (a completion's prompt,
or the chat body rendered as vLLM renders it) to ids, off the event loop when it is long;
the ids to the router's chained block keys at the block size the engines' events give;
the run of leading keys each replica holds; `score.choose` over the eligible replicas with
the load least_outstanding compares (balancer.Replica.score); then the chosen replica is
counted as holding the keys for `kv_speculative_ttl`, so the rest of a burst follows it
before the engine's own events do.

Where the index cannot help the model falls back to prefix_affinity (its pools are built
with the affinity ring for that): a tokenizer that cannot be loaded (for good, with one log
line), no block size yet (no engine has reported a block), or a request whose prompt the
router cannot render as the engine would (media parts, a failing template). Each is
counted in llmgw_router_kv_fallbacks by model and why.

An adapter's requests use its base model's index, chained with the adapter's name in the
seed, as vLLM's events carry the adapter's name (`lora_name`) for its blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmgw.config.router import ModelRouteConfig
from llmgw.kvcache import blocks, score, tokenize
from llmgw.kvcache.index import KvIndex
from llmgw.kvcache.tokenize import NotText, PromptTokenizer, Unavailable
from llmgw.logbound import Throttle
from llmgw.router.routing.balancer import Pool, Replica
from llmgw.transport.requests import Endpoint

log = logging.getLogger("llmgw.router.kv")

# A request body longer than this is tokenized in a thread: a 2000-character prompt takes
# the router's byte-level BPE about a millisecond (bench/kv_tokenize.py), a 4k-token one
# about 20 ms, which the event loop must not wait for.
INLINE_MAX_BYTES = 2000
CHAT = b"/v1/chat/completions"
COMPLETIONS = b"/v1/completions"


def read_tokenizer(folder: str, *,
                   max_tokens: int = tokenize.DEFAULT_MAX_TOKENS) -> PromptTokenizer | Unavailable:
    """The tokenizer in `folder` (the files `tokenize.wanted` names), or why there is none.
    Never raises."""
    root = Path(folder)
    try:
        names = [p.name for p in root.iterdir() if p.is_file()]
        extra = root / tokenize.TEMPLATES_DIR
        if extra.is_dir():
            names += [tokenize.TEMPLATES_DIR + p.name for p in extra.iterdir() if p.is_file()]
        files = {n: (root / n).read_bytes() for n in tokenize.wanted(names)}
    except OSError as e:
        return Unavailable(f"cannot read {folder}: {e.strerror or e}")
    return tokenize.load(files, max_tokens=max_tokens)


def _keys(tok: PromptTokenizer, body: Mapping[str, Any], path: bytes, block_size: int,
          seed: int) -> list[int]:
    """A request's chained block keys, as the engine will tokenize its prompt. Raises
    NotText for a prompt the router cannot tokenize so (embeddings have none to route by)."""
    if path == CHAT:
        ids = tok.encode_chat(now=datetime.now(), **tokenize.chat_args(body))
    elif path == COMPLETIONS:
        ids = tok.encode_completion(body.get("prompt"),  # type: ignore[arg-type]
                                    add_special_tokens=bool(body.get("add_special_tokens", True)))
    else:
        raise NotText("not a completion or chat request")
    return blocks.chain_keys(ids, block_size, seed)


class KvModel:
    """One kv_aware model: its tokenizer, its index and what it counted."""

    def __init__(self, name: str, route: ModelRouteConfig, tok: PromptTokenizer) -> None:
        self.name = name
        self.tok = tok
        self.index = KvIndex(name, route.kv_index_blocks)
        self.weight = route.kv_weight
        self.ttl = route.kv_speculative_ttl
        self.hit_blocks = 0  # predicted: the run the chosen replica held
        self.prompt_blocks = 0
        self.routed = 0
        self.fallbacks: dict[str, int] = {}
        self.batches = 0  # relayed batches applied
        self.stored = 0  # blocks stored, removed, orphaned by the applied batches
        self.removed = 0
        self.orphans = 0
        self.clears: dict[str, int] = {}  # why: life, gone, left
        self.refollows = 0

    def fallback(self, why: str) -> None:
        self.fallbacks[why] = self.fallbacks.get(why, 0) + 1


class KvRouting:
    """The kv_aware models of one router, the replicas the table places at each agent's
    relay, and the per-request choice."""

    def __init__(self, routes: Mapping[str, ModelRouteConfig], *,
                 read: Any = read_tokenizer) -> None:
        self.models: dict[str, KvModel] = {}
        # kv_aware models without a tokenizer: prefix_affinity, and why.
        self.unavailable: dict[str, str] = {}
        self.tokenizer_fallbacks: dict[str, int] = {}
        for name, route in sorted(routes.items()):
            if route.policy != "kv_aware":
                continue
            tok = read(route.tokenizer)
            if isinstance(tok, Unavailable):
                self.unavailable[name] = tok.reason
                log.warning("model %s: kv_aware routing is off, prefix_affinity instead (%s in %s)",
                            name, tok, route.tokenizer)
                continue
            if tok.caveat:
                log.warning("model %s: %s", name, tok.caveat)
            self.models[name] = KvModel(name, route, tok)
        # From the endpoint table: replica -> its kv_aware model; (agent endpoint, agent
        # public key) -> the replicas whose events that agent relays.
        self.replica_model: dict[str, str] = {}
        self.agents: dict[tuple[str, str], frozenset[str]] = {}
        self.changed = trio.Event()  # set on each new table: the links follow `agents`
        self._log = Throttle(burst=5, period=60.0, clock=time.monotonic)
        self.on = bool(self.models or self.unavailable)  # any kv_aware model at all

    # ---- the table ------------------------------------------------------------------

    def table_changed(self, models: Mapping[str, Sequence[Endpoint]]) -> None:
        """The endpoint table's models (served name -> its rows, each with its `kv`: the
        agent's relay, endpoint and key, or None)."""
        replica_model: dict[str, str] = {}
        agents: dict[tuple[str, str], set[str]] = {}
        for name, rows in models.items():
            if name not in self.models:
                continue
            for row in rows:
                replica_model[row.replica_id] = name
                if row.kv is not None:
                    agents.setdefault((row.kv.endpoint, row.kv.key), set()).add(row.replica_id)
        for replica, name in self.replica_model.items():
            if replica_model.get(replica) != name:
                self.models[name].index.clear(replica)  # left the table (or the model)
        self.replica_model = replica_model
        # Every new table, even with the same relays: a replica an agent said Gone for is
        # asked for again once the table has changed (its engine may be back).
        self.agents = {a: frozenset(rs) for a, rs in agents.items()}
        self.changed.set()
        self.changed = trio.Event()

    def model_of(self, replica: str) -> KvModel | None:
        name = self.replica_model.get(replica)
        return None if name is None else self.models.get(name)

    # ---- a request ------------------------------------------------------------------

    def model_for(self, served: str, base: str | None) -> KvModel | None:
        """The kv_aware model that routes requests for `served` (an adapter: its base's)."""
        return self.models.get(served) or (self.models.get(base) if base is not None else None)

    async def keys(self, served: str, base: str | None, body: Mapping[str, Any], size: int,
                   path: bytes) -> tuple[KvModel, list[int]] | None:
        """The model that routes the request and the request's chained block keys, or None:
        routed by the fallback (counted)."""
        km = self.model_for(served, base)
        if km is None:
            name = served if served in self.unavailable else base
            if name is not None and name in self.unavailable:
                self.tokenizer_fallbacks[name] = self.tokenizer_fallbacks.get(name, 0) + 1
            return None
        block_size = km.index.block_size()
        if block_size is None:
            km.fallback("no_block_size")
            return None
        seed = km.index.seed(served if served != km.name else None)
        # Counted and logged here, on the event loop, whichever thread tokenized.
        try:
            if size > INLINE_MAX_BYTES:
                keys = await trio.to_thread.run_sync(_keys, km.tok, body, path, block_size, seed)
            else:
                keys = _keys(km.tok, body, path, block_size, seed)
        except NotText:
            km.fallback("not_text")
            return None
        except Exception as e:  # noqa: BLE001 - a body the tokenizer chokes on costs its choice
            km.fallback("not_text")
            self._log.log(log, logging.INFO, ("tokenize", km.name),
                          "model %s: a request not tokenized (%s: %s); routed by prefix",
                          km.name, type(e).__name__, e)
            return None
        return km, keys

    def choose(self, km: KvModel, keys: list[int], pool: Pool, now: float, stale_after: float,
               exclude: tuple[Replica, ...]) -> Replica | None:
        """The replica for a request whose keys are `keys`; its blocks are then speculated
        on it."""
        cands = [r for r in pool.replicas if r.eligible(now) and r not in exclude]
        if not cands:  # the least bad ejected one, if any
            return pool.choose(now, stale_after, None, exclude)
        matched = km.index.match(keys, now)
        if len(cands) == 1:  # no choice, but the prediction is still counted
            r = cands[0]
        else:
            loads = {r.replica_id: r.score(now, stale_after) for r in cands}
            chosen = score.choose(matched, len(keys), loads, km.weight)
            r = next(c for c in cands if c.replica_id == chosen)
        km.routed += 1
        km.prompt_blocks += len(keys)
        km.hit_blocks += min(matched.get(r.replica_id, 0), len(keys))
        if keys and km.ttl > 0:
            km.index.speculate(r.replica_id, keys, now, km.ttl)
        return r

    # ---- metrics --------------------------------------------------------------------

    def families(self, pools: Mapping[str, Pool] | None = None,
                 adapters: Mapping[str, str] | None = None) -> Iterator[Metric]:
        """The kv_aware figures; with the table's `pools` (and `adapters`, left out: they
        share their base's replicas), the engines' own prefix-cache counters too."""
        def fam(kind: type, name: str, doc: str, labels: Sequence[str] = ("model",)) -> Any:
            return kind(name, doc, labels=list(labels))

        hit = fam(CounterMetricFamily, "llmgw_router_kv_predicted_hit_blocks",
                  "kv_aware: prompt blocks the chosen replica held by the router's index "
                  "(its predicted prefix-cache hits; over prompt_blocks: the predicted hit rate).")
        total = fam(CounterMetricFamily, "llmgw_router_kv_prompt_blocks",
                    "kv_aware: full blocks of the prompts routed by the index.")
        routed = fam(CounterMetricFamily, "llmgw_router_kv_routed",
                     "kv_aware: requests routed by the index.")
        size = fam(GaugeMetricFamily, "llmgw_router_kv_index_blocks",
                   "kv_aware: engine blocks in the router's index, all replicas together.")
        batches = fam(CounterMetricFamily, "llmgw_router_kv_batches",
                      "kv_aware: KV-event batches relayed by the agents and applied to the index.")
        blocks_ = fam(CounterMetricFamily, "llmgw_router_kv_blocks",
                      "kv_aware: blocks in the applied batches, by what became of them (stored, removed, "
                      "orphan: not placeable in a chain).", ("model", "kind"))
        clears = fam(CounterMetricFamily, "llmgw_router_kv_clears",
                     "kv_aware: a replica's index cleared, by why (life: a new life of its events, "
                     "gone: the agent relays none, left: the table no longer has it).", ("model", "why"))
        refollows = fam(CounterMetricFamily, "llmgw_router_kv_refollows",
                        "kv_aware: Follows sent again after a gap in a replica's relayed events.")
        fallbacks = fam(CounterMetricFamily, "llmgw_router_kv_fallbacks",
                        "kv_aware: requests routed by prefix_affinity instead, by why (tokenizer: none "
                        "loaded; no_block_size: no engine event yet; not_text: a prompt not tokenized).",
                        ("model", "why"))
        for name, km in sorted(self.models.items()):
            hit.add_metric([name], km.hit_blocks)
            total.add_metric([name], km.prompt_blocks)
            routed.add_metric([name], km.routed)
            size.add_metric([name], sum(km.index.size(r) for r in km.index.replicas()))
            batches.add_metric([name], km.batches)
            for kind, n in (("stored", km.stored), ("removed", km.removed), ("orphan", km.orphans)):
                blocks_.add_metric([name, kind], n)
            for why, n in sorted(km.clears.items()):
                clears.add_metric([name, why], n)
            refollows.add_metric([name], km.refollows)
            for why, n in sorted(km.fallbacks.items()):
                fallbacks.add_metric([name, why], n)
        off = fam(GaugeMetricFamily, "llmgw_router_kv_tokenizer_unavailable",
                  "kv_aware: 1 for a model whose tokenizer the router could not load at start "
                  "(routed by prefix_affinity; the log says why).")
        for name in sorted(self.unavailable):
            fallbacks.add_metric([name, "tokenizer"], self.tokenizer_fallbacks.get(name, 0))
            off.add_metric([name], 1)
        yield from (hit, total, routed, size, batches, blocks_, clears, refollows, fallbacks, off)
        if pools is not None:
            yield from _engine_prefix_cache(pools, adapters or {})


def _engine_prefix_cache(pools: Mapping[str, Pool], adapters: Mapping[str, str]) -> Iterator[Metric]:
    """vLLM's own prefix-cache counters per replica, as its /metrics last gave them (an
    engine's restart resets them, as Prometheus expects of a counter): the hit rate the
    engines see, beside the one the router predicts."""
    labels = ["model", "replica"]
    hits = CounterMetricFamily("llmgw_router_engine_prefix_cache_hits",
                               "The engine's own prefix-cache hits, in tokens (vllm:prefix_cache_hits).",
                               labels=labels)
    queries = CounterMetricFamily("llmgw_router_engine_prefix_cache_queries",
                                  "The engine's own prefix-cache queries, in tokens "
                                  "(vllm:prefix_cache_queries).", labels=labels)
    for name, pool in sorted(pools.items()):
        if name in adapters:
            continue
        for r in pool.replicas:
            if r.prefix_cache is not None:
                hits.add_metric([name, r.replica_id], r.prefix_cache[0])
                queries.add_metric([name, r.replica_id], r.prefix_cache[1])
    yield hits
    yield queries

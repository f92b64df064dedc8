"""Engine load from /metrics: a pure parser and the trio loop that scrapes sub-second.

vLLM: vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc
(older: vllm:gpu_cache_usage_perc). SGLang: num_running_reqs, num_queue_reqs,
token_usage with a `sglang:` or `sglang_` prefix. Series with several label sets are
summed (usage: the largest). Figures that stop coming go stale in the balancer.

Beside the load, vLLM's own prefix-cache counters (vllm:prefix_cache_hits_total and
vllm:prefix_cache_queries_total, in tokens: vllm/v1/metrics/loggers.py, the counters
"vllm:prefix_cache_hits" and "vllm:prefix_cache_queries") are kept on the replica as the
engine gives them, for the router's /metrics: the engines' own hit rate beside the one
kv_aware routing predicts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

import attrs
import trio

from llmgw.router.routing.balancer import Replica

log = logging.getLogger("llmgw.router.routing.loadwatch")

_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs", "sglang_num_running_reqs")
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "sglang_num_queue_reqs")
_USAGE = (
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
    "sglang_token_usage",
)
_PREFIX_HITS = "vllm:prefix_cache_hits_total"
_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
_KIND: dict[str, int] = {_PREFIX_HITS: 3, _PREFIX_QUERIES: 4}
for _n in _RUNNING:
    _KIND[_n] = 0
for _n in _WAITING:
    _KIND[_n] = 1
for _n in _USAGE:
    _KIND[_n] = 2


@attrs.frozen
class EngineLoad:
    running: float
    waiting: float
    kv_usage: float
    # The engine's prefix-cache counters (tokens), None where it has none.
    prefix_hits: float | None = None
    prefix_queries: float | None = None


def parse_load(text: str) -> EngineLoad | None:
    """Read the figures from Prometheus text; None when none of the names is present."""
    vals = [0.0, 0.0, 0.0, 0.0, 0.0]
    found = False
    prefix = False
    for line in text.splitlines():
        if not line or line[0] == "#" or (line[0] != "v" and line[0] != "s"):
            continue
        end = len(line)
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        name_end = brace if 0 <= brace < space else space
        kind = _KIND.get(line[:name_end])
        if kind is None:
            continue
        value_part = line[line.rfind("}") + 1 :] if brace == name_end else line[name_end:end]
        fields = value_part.split()
        if not fields:
            continue
        try:
            v = float(fields[0])
        except ValueError:
            continue
        if math.isnan(v) or math.isinf(v):
            continue
        if kind >= 3:
            prefix = True
            vals[kind] += v
            continue
        found = True
        if kind == 2:
            vals[2] = max(vals[2], v)
        else:
            vals[kind] += v
    if not found:
        return None
    if prefix:
        return EngineLoad(vals[0], vals[1], vals[2], vals[3], vals[4])
    return EngineLoad(vals[0], vals[1], vals[2])


async def watch_load(
    replicas: Callable[[], list[Replica]],
    fetch: Callable[[Replica, float], Awaitable[str]],
    interval: float,
) -> None:
    """Every `interval`, fetch each replica's /metrics text and record its load.

    `fetch(replica, timeout)` is an async callable returning the text (or raising).
    A replica that fails keeps its old figures, which go stale by themselves."""
    failing: set[str] = set()

    async def one(r: Replica) -> None:
        try:
            text = await fetch(r, max(interval * 4, 1.0))
        except (OSError, trio.TooSlowError, ValueError, trio.BrokenResourceError) as exc:  # noqa: B014
            if r.replica_id not in failing:
                failing.add(r.replica_id)
                log.info("cannot read /metrics of %s (%s): %s", r.replica_id, r.url, exc)
            return
        load = parse_load(text)
        if load is None:
            if r.replica_id not in failing:
                failing.add(r.replica_id)
                log.info("no engine load figures in /metrics of %s", r.replica_id)
            return
        failing.discard(r.replica_id)
        r.set_load(load.running, load.waiting, load.kv_usage, trio.current_time())
        if load.prefix_hits is not None and load.prefix_queries is not None:
            r.prefix_cache = (load.prefix_hits, load.prefix_queries)

    while True:
        deadline = trio.current_time() + interval
        current = replicas()
        if current:
            async with trio.open_nursery() as nursery:
                for r in current:
                    nursery.start_soon(one, r)
        await trio.sleep_until(deadline)

"""The engines' own prefix-cache counters (vLLM's vllm:prefix_cache_hits_total and
vllm:prefix_cache_queries_total, in tokens) read beside their load, kept on the replica and
shown on the router's /metrics per model and replica."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing
from prometheus_client import CollectorRegistry, generate_latest

from llmgw.config.router import ModelRouteConfig
from llmgw.router.kv.policy import KvRouting
from llmgw.router.routing.balancer import Pool, Replica
from llmgw.router.routing.loadwatch import EngineLoad, parse_load, watch_load

# As vLLM 0.32 exports them (prometheus_client adds _total and _created to a counter).
VLLM = """\
vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 600.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 256.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 128.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 999.0
"""


def test_the_engines_prefix_cache_counters_are_read_and_summed_over_engines() -> None:
    assert parse_load(VLLM) == EngineLoad(1.0, 0.0, 0.25, 384.0, 600.0)


def test_an_engine_without_them_has_none() -> None:
    load = parse_load(VLLM.split("# HELP")[0])
    assert load == EngineLoad(1.0, 0.0, 0.25) and load.prefix_hits is None


def test_counters_alone_are_no_load() -> None:
    assert parse_load("vllm:prefix_cache_hits_total 5.0\n") is None


def test_the_router_shows_them_per_model_and_replica() -> None:
    a, b = Replica("r0", "http://127.0.0.1:1"), Replica("r1", "http://127.0.0.1:2")
    a.prefix_cache = (384.0, 600.0)
    kv = KvRouting({"m": ModelRouteConfig()})
    reg = CollectorRegistry()

    class C:
        def collect(self) -> Any:
            return kv.families({"m": Pool([a, b]), "lora": Pool([a])}, {"lora": "m"})

    reg.register(C())
    text = generate_latest(reg).decode()
    assert 'llmgw_router_engine_prefix_cache_hits_total{model="m",replica="r0"} 384.0' in text
    assert 'llmgw_router_engine_prefix_cache_queries_total{model="m",replica="r0"} 600.0' in text
    assert 'replica="r1"' not in text and 'model="lora"' not in text


async def test_the_load_watch_keeps_them_on_the_replica(autojump_clock: trio.testing.MockClock) -> None:
    r = Replica("r0", "http://127.0.0.1:1")

    async def fetch(replica: Replica, timeout: float) -> str:
        return VLLM

    with trio.move_on_after(1.0):
        await watch_load(lambda: [r], fetch, 0.25)
    assert r.prefix_cache == (384.0, 600.0) and r.running == 1.0

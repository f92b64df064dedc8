"""Engine load from /metrics text: vLLM's and SGLang's names, both KV spellings."""

from __future__ import annotations

from llmgw.router.routing.loadwatch import EngineLoad, parse_load

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:num_requests_running_total_other 99
vllm:prompt_tokens_total{model_name="m"} 1234.0
"""

VLLM_OLD = """\
vllm:num_requests_running{model_name="m"} 1.0
vllm:num_requests_waiting{model_name="m"} 0.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.75
"""

SGLANG_COLON = """\
sglang:num_running_reqs{model_name="m"} 7.0
sglang:num_queue_reqs{model_name="m"} 2.0
sglang:token_usage{model_name="m"} 0.4
"""

SGLANG_UNDERSCORE = """\
sglang_num_running_reqs 1
sglang_num_queue_reqs 0
sglang_token_usage 0.1 1700000000000
"""


def test_vllm() -> None:
    assert parse_load(VLLM) == EngineLoad(5.0, 4.0, 0.5)


def test_vllm_old_spelling() -> None:
    assert parse_load(VLLM_OLD) == EngineLoad(1.0, 0.0, 0.75)


def test_sglang_both_prefixes() -> None:
    assert parse_load(SGLANG_COLON) == EngineLoad(7.0, 2.0, 0.4)
    assert parse_load(SGLANG_UNDERSCORE) == EngineLoad(1.0, 0.0, 0.1)


def test_nothing_known_or_garbage() -> None:
    assert parse_load("") is None
    assert parse_load("# only comments\nfoo 1\n") is None
    assert parse_load('vllm:num_requests_running{a="b"} NaN\nvllm:num_requests_waiting x\n') is None


def test_labels_with_spaces_and_braces() -> None:
    text = 'vllm:num_requests_running{model_name="a b} c"} 2\n'
    assert parse_load(text) == EngineLoad(2.0, 0.0, 0.0)

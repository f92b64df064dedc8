"""The agent's read of an engine's requests in flight (agent/lifecycle/inflight.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.lifecycle.inflight import changed, parse_in_flight

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
"""


def test_vllm_sums_running_and_waiting_over_label_sets_and_not_by_reason() -> None:
    assert parse_in_flight(VLLM) == 6


def test_sglang_either_prefix() -> None:
    assert parse_in_flight('sglang:num_running_reqs{tp_rank="0"} 2\nsglang:num_queue_reqs 1\n') == 3
    assert parse_in_flight("sglang_num_running_reqs 0\nsglang_num_queue_reqs 0\n") == 0


def test_absent_or_bad_figures_are_unknown_not_zero() -> None:
    assert parse_in_flight("") == -1
    assert parse_in_flight("process_cpu_seconds_total 3\n") == -1
    assert parse_in_flight("vllm:num_requests_running NaN\n") == -1
    assert parse_in_flight("vllm:num_requests_running -1\n") == -1
    assert parse_in_flight("vllm:num_requests_running{a=\"b\"} x\n") == -1


def test_a_report_only_when_it_moves_between_unknown_none_and_some() -> None:
    assert not changed(3, 7) and not changed(0, 0) and not changed(-1, -1)
    assert changed(-1, 0) and changed(0, 1) and changed(5, 0) and changed(2, -1)


@given(st.text(max_size=300))
def test_any_text_gives_a_count_or_unknown(text: str) -> None:
    assert parse_in_flight(text) >= -1

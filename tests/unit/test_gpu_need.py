"""The free memory an engine needs on a GPU (llmgw.model.gpu_need)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.model.engine import EngineKind
from llmgw.model.gpu_need import CONTEXT_RESERVE, DEFAULT_FRACTION, memory_fraction, memory_need

H100 = 81559  # MiB, as NVML reports an H100 80GB


def test_vllm_default_is_its_own_default_fraction() -> None:
    assert memory_fraction(EngineKind.VLLM, ()) == DEFAULT_FRACTION == 0.9
    assert memory_need(EngineKind.VLLM, (), H100) == int(0.9 * H100) + CONTEXT_RESERVE


def test_the_need_counts_the_engines_own_cuda_context() -> None:
    """vLLM compares utilization x total with what is free once its CUDA context (and
    NCCL) is up: a GPU with exactly 0.9 x total free before the spawn fails its check."""
    assert CONTEXT_RESERVE == 1024
    for kind in (EngineKind.VLLM, EngineKind.SGLANG):
        assert memory_need(kind, (), H100) > int(0.9 * H100)
        assert memory_need(kind, (), H100) - int(0.9 * H100) == CONTEXT_RESERVE
    # At utilization 1.0 no GPU has room for the context too: never placeable.
    assert memory_need(EngineKind.VLLM, ("--gpu-memory-utilization", "1.0"), H100) > H100


def test_vllm_flag_both_forms_and_the_last_one_wins() -> None:
    assert memory_fraction(EngineKind.VLLM, ("--gpu-memory-utilization", "0.5")) == 0.5
    assert memory_fraction(EngineKind.VLLM, ("--gpu-memory-utilization=0.7",)) == 0.7
    args = ("--gpu-memory-utilization", "0.5", "--max-model-len", "512",
            "--gpu-memory-utilization=0.6")
    assert memory_fraction(EngineKind.VLLM, args) == 0.6


def test_vllm_flag_with_underscores_as_vllms_parser_reads_it() -> None:
    """vLLM's FlexibleArgumentParser takes --gpu_memory_utilization for the dashed flag:
    read as unset, 0.95 there would be placed with 0.9 x total free and refused by vLLM."""
    assert memory_fraction(EngineKind.VLLM, ("--gpu_memory_utilization", "0.95")) == 0.95
    assert memory_fraction(EngineKind.VLLM, ("--gpu_memory_utilization=0.95",)) == 0.95
    assert memory_fraction(EngineKind.VLLM, ("--gpu-memory_utilization=0.4",)) == 0.4
    args = ("--gpu_memory_utilization", "0.5", "--gpu-memory-utilization=0.6")
    assert memory_fraction(EngineKind.VLLM, args) == 0.6
    assert memory_need(EngineKind.VLLM, ("--gpu_memory_utilization", "0.95"), H100) == (
        int(0.95 * H100) + CONTEXT_RESERVE)
    # SGLang's parser knows only the dashed flag: the underscored one is its error.
    assert memory_fraction(EngineKind.SGLANG, ("--mem_fraction_static", "0.5")) == 0.9


def test_sglang_reads_its_own_flag_not_vllms() -> None:
    assert memory_fraction(EngineKind.SGLANG, ("--mem-fraction-static", "0.8")) == 0.8
    assert memory_fraction(EngineKind.SGLANG, ("--gpu-memory-utilization", "0.3")) == 0.9
    assert memory_fraction(EngineKind.VLLM, ("--mem-fraction-static", "0.3")) == 0.9


def test_simulated_engine_needs_no_memory_but_the_floor() -> None:
    assert memory_need(EngineKind.SIMULATED, (), H100) == 0
    assert memory_need(EngineKind.SIMULATED, (), H100, gpu_memory_min=1000) == 1000


def test_gpu_memory_min_is_a_floor() -> None:
    assert memory_need(EngineKind.VLLM, ("--gpu-memory-utilization", "0.1"), H100, 40000) == 40000
    assert memory_need(EngineKind.VLLM, (), H100, 1000) == int(0.9 * H100) + CONTEXT_RESERVE


def test_unreadable_or_out_of_range_values_ask_for_the_default() -> None:
    for value in ("", "x", "0", "-0.5", "1.5", "nan", "inf"):
        assert memory_fraction(EngineKind.VLLM, ("--gpu-memory-utilization", value)) == 0.9
    # A flag with no value (last argument) is the engine's error to report.
    assert memory_fraction(EngineKind.VLLM, ("--gpu-memory-utilization",)) == 0.9


@given(st.lists(st.text(max_size=30), max_size=12), st.integers(0, 2**20), st.integers(0, 2**20))
def test_any_args_give_a_need_between_the_floor_and_the_total(args: list[str], total: int, floor: int) -> None:
    for kind in EngineKind:
        need = memory_need(kind, tuple(args), total, floor)
        assert floor <= need <= max(floor, total + CONTEXT_RESERVE)

"""gpu_usage.read_usage reads each GPU on its own."""

from __future__ import annotations

import pytest

from fakes.nvidia_smi import BUSES, NVML_ERROR_GPU_IS_LOST, FakeNvml, FakeNVMLError
from llmgw.agent.gpus.usage import GpuSampler, read_usage


def test_a_lost_gpu_is_left_out_and_the_others_kept() -> None:
    # Was: the lost GPU's error escaped and the metrics showed no GPU at all.
    nvml = FakeNvml(BUSES, uuids=["GPU-d", "GPU-c", "GPU-b", "GPU-a"], lost={1},
                    errors={(2, "nvmlDeviceGetMemoryInfo"): NVML_ERROR_GPU_IS_LOST})
    usage = read_usage(nvml)
    assert [(u.index, u.uuid) for u in usage] == [(0, "GPU-d"), (3, "GPU-a")]
    assert all(u.utilization is None for u in usage)  # the fake has no utilisation call


def test_every_gpu_failing_raises_so_the_sampler_reopens() -> None:
    nvml = FakeNvml(BUSES[:2], lost={0, 1})
    with pytest.raises(FakeNVMLError, match="GPU is lost"):
        read_usage(nvml)
    sampler = GpuSampler(nvml, clock=lambda: 0.0)
    assert sampler.sample() is None and nvml.shutdowns == 1


def test_no_gpus_is_an_empty_list() -> None:
    assert read_usage(FakeNvml([])) == []

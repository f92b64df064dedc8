"""The NVML reader over a fake pynvml-like object (no patching of the real library)."""

from __future__ import annotations

from typing import Any

import pytest

from fakes.nvidia_smi import BUSES, FakeNvml, FakeNVMLError
from llmgw.agent.discovery.nvidia_smi import GpuOutputError
from llmgw.agent.discovery.nvml import read_nvml


def test_fields_are_read_and_converted_to_mib() -> None:
    gpus = read_nvml(FakeNvml(BUSES, numa=[0, 0, 1, 1]))
    assert [g.uuid for g in gpus] == ["GPU-0000", "GPU-0001", "GPU-0002", "GPU-0003"]
    g = gpus[2]
    assert (g.memory_total, g.memory_free) == (81920, 80896)
    assert g.name == "NVIDIA A100-SXM4-80GB"
    assert g.compute_capability == "8.0"
    assert g.pci_bus_id == "00000000:47:00.0"
    assert g.numa_node == 1
    assert all(g.nvlink_peers == {} for g in gpus)


def test_direct_nvlinks_are_matched_by_pci_bus_id() -> None:
    # GPU0 - GPU1 with 4 links, GPU2 - GPU3 with 2; remote ids in sysfs form.
    links = {
        0: ["0000:0f:00.0"] * 4,
        1: ["0000:07:00.0"] * 4,
        2: ["0000:4e:00.0"] * 2,
        3: ["0000:47:00.0"] * 2,
    }
    gpus = read_nvml(FakeNvml(BUSES, links, numa=[0, 0, 1, 1]))
    assert gpus[0].nvlink_peers == {"GPU-0001": 4}
    assert gpus[3].nvlink_peers == {"GPU-0002": 2}


def test_nvswitch_links_make_every_gpu_a_peer() -> None:
    switches = [f"00000000:{b:02X}:00.0" for b in (0xA0, 0xA1, 0xA2, 0xA3)]
    links = {h: [switches[k % 4] for k in range(18)] for h in range(4)}
    gpus = read_nvml(FakeNvml(BUSES, links, numa=[0, 0, 1, 1]))
    assert gpus[1].nvlink_peers == {"GPU-0000": 18, "GPU-0002": 18, "GPU-0003": 18}


def test_numa_falls_back_to_sysfs_lookup() -> None:
    seen: list[str] = []

    def numa_of(bus: str) -> int | None:
        seen.append(bus)
        return 7

    gpus = read_nvml(FakeNvml(BUSES[:1], numa_api=False), numa_of)
    assert gpus[0].numa_node == 7
    assert seen == ["00000000:07:00.0"]


def test_bad_bus_id_from_nvml_is_an_output_error() -> None:
    with pytest.raises(GpuOutputError, match="not a PCI bus id"):
        read_nvml(FakeNvml(["not-a-bus-id"]))


class LostGpuNvml(FakeNvml):
    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        raise FakeNVMLError("GPU is lost")


def test_nvml_error_mid_read_is_an_output_error() -> None:
    with pytest.raises(GpuOutputError, match="NVML: GPU is lost"):
        read_nvml(LostGpuNvml(BUSES))

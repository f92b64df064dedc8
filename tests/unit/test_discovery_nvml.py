"""The NVML reader over a fake pynvml-like object (no patching of the real library)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fakes.nvidia_smi import (
    BUSES,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_UNKNOWN,
    NVML_SUCCESS,
    FakeNvml,
    FakeNVMLError,
)
from llmgw.agent.discovery.nvidia_smi import GpuOutputError
from llmgw.agent.discovery.nvml import proc_cmdline, read_gpu_memory, read_nvml, shorten_command
from llmgw.agent.gpus.memory import GpuMemory
from llmgw.model.inventory import GpuProcess

GIB = 1024**3


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


def test_bad_bus_id_from_nvml_is_that_gpus_problem() -> None:
    (g,) = read_nvml(FakeNvml(["not-a-bus-id"]))
    assert g.pci_bus_id == ""
    assert g.problems == ("NVML error reading PCI bus id: not a PCI bus id: 'not-a-bus-id'",)


class LostGpuNvml(FakeNvml):
    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        raise FakeNVMLError("GPU is lost")


def test_nvml_error_mid_read_is_that_gpus_problem_not_an_output_error() -> None:
    # Was: one GPU lost mid-read raised GpuOutputError and hid every GPU of the node.
    gpus = read_nvml(LostGpuNvml(BUSES))
    assert [g.uuid for g in gpus] == ["GPU-0000", "GPU-0001", "GPU-0002", "GPU-0003"]
    assert all(g.problems == ("lost: GPU is lost",) and not g.healthy for g in gpus)


def test_one_lost_gpu_does_not_hide_the_others() -> None:
    nvml = FakeNvml(BUSES, errors={(2, "nvmlDeviceGetMemoryInfo"): NVML_ERROR_GPU_IS_LOST})
    gpus = read_nvml(nvml)
    assert [g.healthy for g in gpus] == [True, True, False, True]
    lost = gpus[2]
    assert (lost.uuid, lost.pci_bus_id, lost.memory_total) == ("GPU-0002", BUSES[2], 0)
    assert lost.problems == ("lost: GPU is lost",)
    assert gpus[3].memory_total == 81920


def test_gpu_without_a_handle_gets_a_placeholder_uuid_and_says_so() -> None:
    links = {0: ["0000:0f:00.0"] * 4, 1: ["0000:07:00.0"] * 4}
    gpus = read_nvml(FakeNvml(BUSES, links, lost={3}))
    assert len(gpus) == 4
    g = gpus[3]
    assert (g.index, g.uuid, g.pci_bus_id) == (3, "unknown-3", "")
    assert g.problems[0] == "lost: GPU is lost"
    assert "listed as unknown-3" in g.problems[1]
    assert not g.placeable
    assert gpus[0].nvlink_peers == {"GPU-0001": 4} and gpus[0].healthy


def test_other_nvml_errors_name_the_field_and_reading_goes_on() -> None:
    nvml = FakeNvml(BUSES[:1], errors={(0, "nvmlDeviceGetName"): NVML_ERROR_UNKNOWN,
                                       (0, "nvmlDeviceGetUUID"): NVML_ERROR_UNKNOWN})
    (g,) = read_nvml(nvml)
    assert g.memory_total == 81920  # read after the failed field
    assert g.uuid == f"unknown-{BUSES[0]}"
    assert g.problems == (
        "NVML error reading UUID: Unknown Error",
        "NVML error reading name: Unknown Error",
        f"UUID unknown (NVML could not read it): listed as unknown-{BUSES[0]}",
    )


class NoCountNvml(FakeNvml):
    def nvmlDeviceGetCount(self) -> int:
        raise FakeNVMLError(NVML_ERROR_UNKNOWN)


def test_only_a_failing_count_is_an_output_error() -> None:
    with pytest.raises(GpuOutputError, match="NVML: Unknown Error"):
        read_nvml(NoCountNvml(BUSES))


def test_uuids_follow_the_index_not_their_sort_order() -> None:
    uuids = ["GPU-dd", "GPU-aa", "GPU-cc", "GPU-bb"]
    links = {0: ["0000:0f:00.0"] * 2, 1: ["0000:07:00.0"] * 2}
    gpus = read_nvml(FakeNvml(BUSES, links, uuids=uuids))
    assert [(g.index, g.uuid) for g in gpus] == list(enumerate(uuids))
    assert gpus[0].nvlink_peers == {"GPU-aa": 2}
    assert gpus[1].nvlink_peers == {"GPU-dd": 2}


def test_health_is_read_per_gpu() -> None:
    fs = FakeNvml
    nvml = FakeNvml(
        BUSES + ["00000000:87:00.0", "00000000:90:00.0"],
        mig={0}, ecc={1: 2}, remap_pending={2}, remap_failed={3}, retired_pending={4},
        fabric={4: (fs.NVML_GPU_FABRIC_STATE_COMPLETED, NVML_SUCCESS),
                5: (fs.NVML_GPU_FABRIC_STATE_IN_PROGRESS, NVML_SUCCESS)},
    )
    gpus = read_nvml(nvml)
    assert [g.problems for g in gpus] == [
        ("MIG mode is on (llmgw places whole GPUs)",),
        ("no new work: 2 volatile uncorrected ECC errors",),
        ("no new work: row remap pending (reset the GPU when it is idle)",),
        ("row remap failed",),
        ("no new work: retired pages pending (reset the GPU when it is idle)",),
        ("NVSwitch fabric not ready (in progress)",),
    ]
    assert [g.healthy for g in gpus] == [False, True, True, False, True, False]


def test_fabric_registration_failure_names_nvmls_status() -> None:
    nvml = FakeNvml(BUSES[:1], fabric={0: (FakeNvml.NVML_GPU_FABRIC_STATE_COMPLETED, NVML_ERROR_UNKNOWN)})
    (g,) = read_nvml(nvml)
    assert g.problems == ("NVSwitch fabric registration failed: Unknown Error",)


def test_not_supported_health_calls_are_no_problem() -> None:
    assert all(g.healthy for g in read_nvml(FakeNvml(BUSES, health_api=False)))


def test_a_health_call_failing_otherwise_is_a_problem() -> None:
    nvml = FakeNvml(BUSES[:2], errors={(1, "nvmlDeviceGetTotalEccErrors"): NVML_ERROR_UNKNOWN})
    gpus = read_nvml(nvml)
    assert gpus[0].healthy
    assert gpus[1].problems == ("NVML error reading ECC errors: Unknown Error",)


def test_lost_during_health_reads_stops_asking() -> None:
    nvml = FakeNvml(BUSES[:1], errors={(0, "nvmlDeviceGetMigMode"): NVML_ERROR_GPU_IS_LOST,
                                       (0, "nvmlDeviceGetRemappedRows"): NVML_ERROR_UNKNOWN})
    (g,) = read_nvml(nvml)
    assert g.problems == ("lost: GPU is lost",)


def proc_tree(root: Path, cmdlines: dict[int, bytes]) -> None:
    for pid, raw in cmdlines.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "cmdline").write_bytes(raw)


def test_compute_processes_with_command_and_memory(tmp_path: Path) -> None:
    proc_tree(tmp_path, {4242: b"python\0train.py\0--epochs\x003\0", 77: b"x" * 200})
    nvml = FakeNvml(
        BUSES[:2],
        processes={0: [(17, None), (4242, 61 * GIB), (77, GIB)], 1: [(4242, 2 * GIB)]},
        process_names={17: "nvidia-cuda-mps-server"},
    )
    gpus = read_nvml(nvml, cmdline_of=lambda pid: proc_cmdline(pid, str(tmp_path)))
    assert gpus[0].processes == (
        GpuProcess(4242, "python train.py --epochs 3", 61 * 1024),
        GpuProcess(77, "x" * 79 + "…", 1024),
        GpuProcess(17, "nvidia-cuda-mps-server", 0),
    )
    assert gpus[1].processes == (GpuProcess(4242, "python train.py --epochs 3", 2048),)
    assert all(g.healthy for g in gpus)


def test_processes_failing_is_that_gpus_problem() -> None:
    nvml = FakeNvml(BUSES[:2], errors={(0, "nvmlDeviceGetComputeRunningProcesses"): NVML_ERROR_UNKNOWN})
    gpus = read_nvml(nvml, cmdline_of=lambda _pid: "")
    assert gpus[0].problems == ("NVML error reading processes: Unknown Error",)
    assert gpus[1].healthy


def test_proc_cmdline_of_a_gone_process_is_empty(tmp_path: Path) -> None:
    assert proc_cmdline(999, str(tmp_path)) == ""


@given(st.binary(max_size=400))
def test_shorten_command_is_one_bounded_printable_line(raw: bytes) -> None:
    line = shorten_command(raw)
    assert len(line) <= 80
    assert line.isprintable()
    assert line == line.strip()


def test_read_gpu_memory_keeps_the_others_when_one_is_lost() -> None:
    nvml = FakeNvml(BUSES, uuids=["GPU-d", "GPU-c", "GPU-b", "GPU-a"], lost={1},
                    errors={(2, "nvmlDeviceGetMemoryInfo"): NVML_ERROR_GPU_IS_LOST},
                    processes={3: [(4242, 61 * GIB)]}, mig={0})
    mem = read_gpu_memory(nvml, cmdline_of=lambda pid: f"cmd {pid}")
    assert mem is not None
    assert set(mem) == {"GPU-d", "unknown-1", "GPU-b", "GPU-a"}
    assert mem["GPU-a"] == GpuMemory("GPU-a", 3, 81920, 80896, (GpuProcess(4242, "cmd 4242", 62464),), ())
    assert mem["GPU-b"].problems == ("lost: GPU is lost",)
    assert mem["unknown-1"].index == 1 and mem["unknown-1"].problems[0] == "lost: GPU is lost"
    assert mem["GPU-d"].problems == ("MIG mode is on (llmgw places whole GPUs)",)
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


def test_read_gpu_memory_is_none_when_nvml_does_not_answer() -> None:
    assert read_gpu_memory(FakeNvml(BUSES, fail_init=True)) is None
    nvml = NoCountNvml(BUSES)
    assert read_gpu_memory(nvml) is None
    assert (nvml.inits, nvml.shutdowns) == (1, 1)

"""NVML reads with history (nvml.GpuReads, issue 30 item 3): a read error counts only after
several in a row, and meanwhile the GPU keeps what it read last; the recovery action."""

from __future__ import annotations

from fakes.nvidia_smi import BUSES, NVML_ERROR_GPU_IS_LOST, NVML_ERROR_UNKNOWN, FakeNvml
from llmgw.agent.discovery.gpu_health import READ_ERRORS_IN_A_ROW
from llmgw.agent.discovery.nvml import GpuReads, read_gpu_memory, read_nvml


def test_a_single_transient_error_does_not_make_the_gpu_unhealthy() -> None:
    """Before issue 30 one Unknown Error on one field was a problem, and the server moved
    every replica on the GPU."""
    nvml = FakeNvml(BUSES[:2])
    reads = GpuReads()
    assert all(g.healthy for g in read_nvml(nvml, reads=reads))
    nvml.errors[(1, "nvmlDeviceGetTotalEccErrors")] = NVML_ERROR_UNKNOWN
    for _ in range(READ_ERRORS_IN_A_ROW - 1):
        gpus = read_nvml(nvml, reads=reads)
        assert [g.problems for g in gpus] == [(), ()]
    (_, g1) = read_nvml(nvml, reads=reads)
    assert g1.problems == (f"NVML error reading ECC errors ({READ_ERRORS_IN_A_ROW} reads in a row): "
                           "Unknown Error",)
    assert not g1.healthy
    del nvml.errors[(1, "nvmlDeviceGetTotalEccErrors")]
    assert [g.problems for g in read_nvml(nvml, reads=reads)] == [(), ()]


def test_a_good_read_between_errors_starts_the_count_again() -> None:
    nvml = FakeNvml(BUSES[:1])
    reads = GpuReads()
    key = (0, "nvmlDeviceGetRemappedRows")
    for _ in range(4):
        nvml.errors[key] = NVML_ERROR_UNKNOWN
        for _ in range(READ_ERRORS_IN_A_ROW - 1):
            assert read_nvml(nvml, reads=reads)[0].problems == ()
        del nvml.errors[key]
        assert read_nvml(nvml, reads=reads)[0].problems == ()


def test_a_uuid_or_memory_read_error_keeps_what_was_read_last() -> None:
    """One failed UUID read used to rename the GPU "unknown-<bus>": to the server a GPU
    gone, its replica's GPU with it."""
    nvml = FakeNvml(BUSES[:1], processes={0: [(4242, 2 * 1024**3)]})
    reads = GpuReads()
    (before,) = read_nvml(nvml, reads=reads, cmdline_of=lambda _pid: "python train.py")
    nvml.errors.update({(0, "nvmlDeviceGetUUID"): NVML_ERROR_UNKNOWN,
                        (0, "nvmlDeviceGetMemoryInfo"): NVML_ERROR_UNKNOWN,
                        (0, "nvmlDeviceGetComputeRunningProcesses"): NVML_ERROR_UNKNOWN})
    (during,) = read_nvml(nvml, reads=reads)
    assert during.uuid == before.uuid == "GPU-0000"
    assert (during.memory_total, during.memory_free) == (before.memory_total, before.memory_free)
    assert during.processes == before.processes and during.problems == ()


def test_a_handle_error_is_the_last_record_until_the_streak() -> None:
    nvml = FakeNvml(BUSES[:2])
    reads = GpuReads()
    first = read_nvml(nvml, reads=reads)
    nvml.errors[(1, "nvmlDeviceGetHandleByIndex")] = NVML_ERROR_UNKNOWN
    for _ in range(READ_ERRORS_IN_A_ROW - 1):
        assert read_nvml(nvml, reads=reads) == first
    (_, g1) = read_nvml(nvml, reads=reads)
    assert g1.uuid == "GPU-0001" and not g1.healthy
    assert g1.problems[0].startswith("NVML error reading the handle")


def test_lost_counts_at_once_and_keeps_the_gpus_uuid() -> None:
    nvml = FakeNvml(BUSES[:2])
    reads = GpuReads()
    read_nvml(nvml, reads=reads)
    nvml.lost.add(1)
    (_, g1) = read_nvml(nvml, reads=reads)
    assert g1.uuid == "GPU-0001" and g1.problems == ("lost: GPU is lost",)
    assert reads.health()["GPU-0001"].lost
    nvml.lost.discard(1)
    nvml.errors[(1, "nvmlDeviceGetMemoryInfo")] = NVML_ERROR_GPU_IS_LOST
    (_, g1) = read_nvml(nvml, reads=reads)
    assert g1.problems == ("lost: GPU is lost",)


def test_without_history_every_error_counts_at_once() -> None:
    """A one-shot reader (the GPU check, `llmgw gpus`) has no next read to wait for."""
    nvml = FakeNvml(BUSES[:1], errors={(0, "nvmlDeviceGetTotalEccErrors"): NVML_ERROR_UNKNOWN})
    assert read_nvml(nvml)[0].problems == ("NVML error reading ECC errors: Unknown Error",)


def test_the_check_before_a_spawn_shares_the_streak() -> None:
    nvml = FakeNvml(BUSES[:1], errors={(0, "nvmlDeviceGetRemappedRows"): NVML_ERROR_UNKNOWN})
    reads = GpuReads()
    read_nvml(nvml, reads=reads)
    mem = read_gpu_memory(nvml, reads=reads)
    assert mem is not None and mem["GPU-0000"].problems == ()
    mem = read_gpu_memory(nvml, reads=reads)
    assert mem is not None and mem["GPU-0000"].problems[0].startswith("NVML error reading remapped rows")


def test_recovery_action_is_read_from_the_field_value() -> None:
    nvml = FakeNvml(BUSES[:3], recovery={1: 1, 2: 4})
    reads = GpuReads()
    gpus = read_nvml(nvml, reads=reads)
    assert [g.problems for g in gpus] == [
        (),
        ("NVML asks to reset the GPU (recovery action 1)",),
        ("NVML asks to drain peer-to-peer traffic and reset the GPU (recovery action 4)",),
    ]
    assert reads.health()["GPU-0001"].recovery_action == 1


def test_recovery_action_not_supported_is_no_problem() -> None:
    nvml = FakeNvml(BUSES[:1], recovery={0: 1}, recovery_api=False)
    reads = GpuReads()
    assert read_nvml(nvml, reads=reads)[0].problems == ()
    assert reads.health()["GPU-0000"].recovery_action is None


def test_a_pending_remap_is_soft() -> None:
    nvml = FakeNvml(BUSES[:2], remap_pending={1}, ecc={1: 1})
    (g0, g1) = read_nvml(nvml, reads=GpuReads())
    assert g0.placeable and g1.healthy and not g1.placeable
    assert g1.soft_problems == ("1 volatile uncorrected ECC error",
                                "row remap pending (reset the GPU when it is idle)")

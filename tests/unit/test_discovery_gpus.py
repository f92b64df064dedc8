"""Choosing the GPU source, with fake nvidia-smi scripts and a fake NVML."""

from __future__ import annotations

from pathlib import Path

from fakes import nvidia_smi as fake
from fakes.nvidia_smi import BUSES, FakeNvml
from llmgw.agent.discovery.gpus import numa_from_sysfs, read_gpus
from llmgw.config.agent import DiscoveryConfig
from llmgw.model.inventory import GpuSource


def smi_config(exe: Path | str = "") -> DiscoveryConfig:
    return DiscoveryConfig(nvidia_smi=str(exe), prefer_nvml=False)


def test_skip_gpus_reports_none_and_says_so(tmp_path: Path) -> None:
    exe = fake.nvlink_board(tmp_path)
    r = read_gpus(DiscoveryConfig(nvidia_smi=str(exe), skip_gpus=True))
    assert (r.gpus, r.source, r.warnings) == ((), GpuSource.SKIPPED, ())


def test_nvml_is_preferred_when_it_loads(tmp_path: Path) -> None:
    nvml = FakeNvml(BUSES, numa=[0, 0, 1, 1])
    r = read_gpus(DiscoveryConfig(nvidia_smi=str(fake.pcie_box(tmp_path))), nvml=nvml)
    assert r.source is GpuSource.NVML
    assert len(r.gpus) == 4
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


def test_nvml_that_does_not_load_falls_back_to_nvidia_smi(tmp_path: Path) -> None:
    exe = fake.nvlink_board(tmp_path)
    r = read_gpus(DiscoveryConfig(nvidia_smi=str(exe)), nvml=FakeNvml([], fail_init=True))
    assert r.source is GpuSource.NVIDIA_SMI
    assert len(r.gpus) == 8
    assert r.warnings == ()
    assert r.gpus[0].nvlink_peers == {fake.uuid(j): 18 for j in range(1, 8)}


def test_nvidia_smi_found_on_path(tmp_path: Path) -> None:
    fake.pcie_box(tmp_path / "bin")
    r = read_gpus(smi_config(), search_path=str(tmp_path / "bin"))
    assert r.source is GpuSource.NVIDIA_SMI
    assert [g.name for g in r.gpus] == ["NVIDIA L40S"] * 4
    assert all(g.nvlink_peers == {} for g in r.gpus)


def test_no_nvml_and_no_nvidia_smi_is_zero_gpus_and_one_warning(tmp_path: Path) -> None:
    r = read_gpus(DiscoveryConfig(), nvml=FakeNvml([], fail_init=True), search_path=str(tmp_path))
    assert r.gpus == ()
    assert r.source is GpuSource.NONE
    assert len(r.warnings) == 1
    assert "NVML did not load" in r.warnings[0]
    assert "nvidia-smi not found" in r.warnings[0]


def test_configured_nvidia_smi_missing_is_a_warning(tmp_path: Path) -> None:
    r = read_gpus(smi_config(tmp_path / "nope" / "nvidia-smi"))
    assert r.source is GpuSource.NONE
    assert len(r.warnings) == 1 and "not executable" in r.warnings[0]


def test_nvidia_smi_failing_is_a_warning_with_its_stderr(tmp_path: Path) -> None:
    r = read_gpus(smi_config(fake.failing(tmp_path)))
    assert r.gpus == ()
    assert r.source is GpuSource.NONE
    assert len(r.warnings) == 1
    assert "status 18" in r.warnings[0]
    assert "Driver/library version mismatch" in r.warnings[0]


def test_nvidia_smi_garbage_is_a_warning_with_its_stderr(tmp_path: Path) -> None:
    r = read_gpus(smi_config(fake.garbage(tmp_path)))
    assert r.gpus == ()
    assert len(r.warnings) == 1
    assert "odd state" in r.warnings[0]


def test_gpus_are_ordered_by_pci_bus_id_not_enumeration(tmp_path: Path) -> None:
    lines = [
        fake.query_line(0, "NVIDIA H100", "DB", 81559, 81000, "9.0"),
        fake.query_line(1, "NVIDIA H100", "18", 81559, 81000, "9.0"),
    ]
    topo = fake.topo_matrix([["X", "NV18"], ["NV18", "X"]], ["1", "0"])
    exe = fake.write_script(tmp_path, "\n".join(lines) + "\n", topo)
    r = read_gpus(smi_config(exe))
    assert [g.pci_bus_id for g in r.gpus] == ["00000000:18:00.0", "00000000:DB:00.0"]
    assert [g.index for g in r.gpus] == [1, 0]
    assert r.gpus[0].nvlink_peers == {fake.uuid(0): 18}
    assert [g.numa_node for g in r.gpus] == [0, 1]


def test_numa_from_sysfs(tmp_path: Path) -> None:
    dev = tmp_path / "0000:1b:00.0"
    dev.mkdir()
    (dev / "numa_node").write_text("1\n")
    (tmp_path / "0000:2b:00.0").mkdir()
    (tmp_path / "0000:2b:00.0" / "numa_node").write_text("-1\n")
    assert numa_from_sysfs("00000000:1B:00.0", str(tmp_path)) == 1
    assert numa_from_sysfs("00000000:2B:00.0", str(tmp_path)) is None
    assert numa_from_sysfs("00000000:3B:00.0", str(tmp_path)) is None


def test_driver_without_compute_cap_field_is_asked_again_without_it(tmp_path: Path) -> None:
    r = read_gpus(smi_config(fake.legacy_driver(tmp_path)))
    assert r.source is GpuSource.NVIDIA_SMI
    assert [g.compute_capability for g in r.gpus] == ["", ""]
    assert r.gpus[0].nvlink_peers == {fake.uuid(1): 2}
    assert r.warnings == ()


def test_nvidia_smi_one_bad_line_and_non_zero_exit_keeps_the_good_gpus(tmp_path: Path) -> None:
    # Was: exit 15 (one GPU lost) dropped all four GPUs of the node.
    r = read_gpus(smi_config(fake.one_bad_line(tmp_path)))
    assert r.source is GpuSource.NVIDIA_SMI
    assert [g.uuid for g in r.gpus] == [fake.uuid(0), fake.uuid(1), fake.uuid(3)]
    assert r.gpus[0].nvlink_peers == {fake.uuid(1): 18, fake.uuid(3): 18}
    assert len(r.warnings) == 2
    status, line = r.warnings
    assert "exited with status 15" in status and "GPU is lost" in status and "kept the 3 GPU(s)" in status
    assert "unreadable nvidia-smi line 'Unable to determine the device handle" in line


def test_nvidia_smi_stderr_in_a_warning_is_bounded(tmp_path: Path) -> None:
    exe = fake.write_script(tmp_path, "", "", rc=9, stderr="E" * 10_000)
    r = read_gpus(smi_config(exe))
    assert r.gpus == () and len(r.warnings) == 1 and len(r.warnings[0]) < 500


def test_nvml_lost_gpu_is_listed_last_and_the_others_are_kept(tmp_path: Path) -> None:
    nvml = FakeNvml(BUSES, lost={0})
    r = read_gpus(DiscoveryConfig(nvidia_smi=str(fake.pcie_box(tmp_path))), nvml=nvml)
    assert r.source is GpuSource.NVML
    assert [g.uuid for g in r.gpus] == ["GPU-0001", "GPU-0002", "GPU-0003", "unknown-0"]
    assert [g.healthy for g in r.gpus] == [True, True, True, False]

"""Pure parsers of nvidia-smi output, on the text the fake scripts print."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fakes import nvidia_smi as fake
from llmgw.agent.discovery.nvidia_smi import (
    QUERY_ARGS,
    GpuOutputError,
    apply_topology,
    normalise_bus_id,
    parse_query_gpu,
    parse_topo,
    sysfs_bus_id,
)


def _out(exe: Path, *args: str) -> str:
    return subprocess.run([str(exe), *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize(
    ("raw", "canon"),
    [
        ("00000000:1B:00.0", "00000000:1B:00.0"),
        ("0000:1b:00.0", "00000000:1B:00.0"),
        ("1b:00.0", "00000000:1B:00.0"),
        ("00000001:c1:00.1", "00000001:C1:00.1"),
    ],
)
def test_bus_ids_are_normalised(raw: str, canon: str) -> None:
    assert normalise_bus_id(raw) == canon


def test_sysfs_bus_id() -> None:
    assert sysfs_bus_id("00000000:1B:00.0") == "0000:1b:00.0"


def test_bad_bus_id_is_an_output_error() -> None:
    with pytest.raises(GpuOutputError):
        normalise_bus_id("GPU0")


def test_query_gpu_parses_every_field(tmp_path: Path) -> None:
    gpus = parse_query_gpu(_out(fake.nvlink_board(tmp_path), *QUERY_ARGS))
    assert len(gpus) == 8
    g = gpus[3]
    assert g.index == 3
    assert g.uuid == fake.uuid(3)
    assert g.name == "NVIDIA H100 80GB HBM3"
    assert (g.memory_total, g.memory_free) == (81559, 80997)
    assert g.pci_bus_id == "00000000:5D:00.0"
    assert g.compute_capability == "9.0"


def test_query_gpu_garbage_is_an_output_error() -> None:
    with pytest.raises(GpuOutputError):
        parse_query_gpu("<html>segfault in libnvidia-ml</html>\n")


def test_topo_of_nvlink_board_is_all_nv18_with_numa(tmp_path: Path) -> None:
    topo = parse_topo(_out(fake.nvlink_board(tmp_path), "topo", "-m"))
    assert set(topo.nvlinks) == set(range(8))  # NIC rows ignored
    assert topo.nvlinks[0] == {j: 18 for j in range(1, 8)}
    assert topo.numa == {i: 0 if i < 4 else 1 for i in range(8)}


def test_topo_of_pcie_box_has_no_nvlink(tmp_path: Path) -> None:
    topo = parse_topo(_out(fake.pcie_box(tmp_path), "topo", "-m"))
    assert all(peers == {} for peers in topo.nvlinks.values())
    assert topo.numa[2] == 1


def test_mixed_board_pairs_become_uuid_peers(tmp_path: Path) -> None:
    exe = fake.mixed_board(tmp_path)
    gpus = apply_topology(parse_query_gpu(_out(exe, *QUERY_ARGS)), parse_topo(_out(exe, "topo", "-m")))
    assert gpus[0].nvlink_peers == {fake.uuid(1): 12}
    assert gpus[3].nvlink_peers == {fake.uuid(2): 12}
    assert [g.numa_node for g in gpus] == [0, 0, 1, 1]


def test_space_separated_topo_is_read() -> None:
    text = (
        "        GPU0  GPU1  CPU Affinity  NUMA Affinity\n"
        "GPU0     X    NV4   0-31          0\n"
        "GPU1    NV4    X    0-31          N/A\n"
        "\nLegend:\n  X = Self\n"
    )
    topo = parse_topo(text)
    assert topo.nvlinks == {0: {1: 4}, 1: {0: 4}}
    assert topo.numa == {0: 0, 1: None}


def test_topo_without_gpu_columns_is_an_output_error() -> None:
    with pytest.raises(GpuOutputError):
        parse_topo("No devices were found\n")


def test_not_available_memory_reads_as_zero() -> None:
    line = f"0, {fake.uuid(0)}, NVIDIA GH200 480GB, [N/A], [N/A], 00000009:01:00.0, 9.0\n"
    (g,) = parse_query_gpu(line)
    assert (g.memory_total, g.memory_free, g.pci_bus_id) == (0, 0, "00000009:01:00.0")

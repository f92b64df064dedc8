"""Each HCA's place in the PCIe tree and its NUMA node, from its `device` link."""

from __future__ import annotations

from pathlib import Path

from fakes.sysfs import EIGHT_GPU_NUMA, add_hca, eight_gpu_layout, hca_device, ib_tree, pcie_tree
from llmgw.agent.discovery.infiniband import read_hcas
from llmgw.model.pcie import link_kind


def test_hca_pci_path_and_numa_node(tmp_path: Path) -> None:
    sys_root, ib = tmp_path / "sys", tmp_path / "sys" / "class" / "infiniband"
    layout = pcie_tree(sys_root, eight_gpu_layout(), EIGHT_GPU_NUMA)
    for i in range(4):
        add_hca(ib, f"mlx5_{i}")
        hca_device(ib, f"mlx5_{i}", sys_root, layout[f"mlx5_{i}"][-1])
    hcas = read_hcas(str(ib))
    assert [h.pci_path for h in hcas] == [layout[f"mlx5_{i}"] for i in range(4)]
    assert [h.numa_node for h in hcas] == [0, 0, 1, 1]
    # The fabric work pairs GPUs with the HCA under their switch.
    assert link_kind(layout["gpu2"], hcas[1].pci_path, 0, hcas[1].numa_node) == "PIX"
    assert link_kind(layout["gpu2"], hcas[2].pci_path, 0, hcas[2].numa_node) == "SYS"


def test_trees_without_device_links_are_unknown(tmp_path: Path) -> None:
    ib_tree(tmp_path, 2)
    assert [(h.pci_path, h.numa_node) for h in read_hcas(str(tmp_path))] == [((), None)] * 2


def test_device_link_to_nowhere_or_outside_pci_is_unknown(tmp_path: Path) -> None:
    ib, net = tmp_path / "ib", tmp_path / "devices" / "virtual" / "net" / "eth0"
    add_hca(ib, "mlx5_0")
    (ib / "mlx5_0" / "device").symlink_to(tmp_path / "gone")
    add_hca(ib, "rxe0")  # soft RoCE: its device is a net device, not PCI
    net.mkdir(parents=True)
    (net / "numa_node").write_text("0\n")
    (ib / "rxe0" / "device").symlink_to(net)
    hcas = read_hcas(str(ib))
    assert [(h.name, h.pci_path, h.numa_node) for h in hcas] == [
        ("mlx5_0", (), None), ("rxe0", (), None),
    ]

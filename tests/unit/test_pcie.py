"""PCIe ancestry from fake sysfs trees, and link kinds as `nvidia-smi topo -m` names them."""

from __future__ import annotations

import itertools
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from fakes.sysfs import EIGHT_GPU_NUMA, eight_gpu_layout, pcie_tree
from llmgw.agent.discovery.pcie import (
    numa_node,
    parse_pci_path,
    pci_path,
    sysfs_name,
)
from llmgw.model.pcie import link_kind

# The bus ids NVML gives for the layout's devices: 8-digit domain, upper case.
LAYOUT = eight_gpu_layout()


def nvml_id(name: str) -> str:
    return "0000" + LAYOUT[name][-1].upper()


def node(tmp_path: Path) -> str:
    pcie_tree(tmp_path, LAYOUT, EIGHT_GPU_NUMA)
    return str(tmp_path)


def test_bus_id_forms() -> None:
    assert sysfs_name("00000000:18:00.0") == "0000:18:00.0"
    assert sysfs_name("00000000:DB:1F.7") == "0000:db:1f.7"
    assert sysfs_name("0000:db:00.1") == "0000:db:00.1"
    assert sysfs_name("00010000:01:00.0") == "10000:01:00.0"  # Intel VMD's domain
    for bad in ("", "18:00.0", "0000:18:00.8", "0000:18:20.0", "x:18:00.0", "0000:18:00"):
        assert sysfs_name(bad) == "", bad


def test_ancestry_is_read_from_the_resolved_link(tmp_path: Path) -> None:
    root = node(tmp_path)
    assert pci_path(nvml_id("gpu0"), root) == (
        "pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0",
    )
    assert pci_path("0000:3b:00.0", root) == LAYOUT["gpu3"]
    # A bridge is a PCI device too, with its own, shorter, ancestry.
    assert pci_path("0000:16:00.0", root) == ("pci0000:15", "0000:15:01.0", "0000:16:00.0")


def test_unknown_devices_and_broken_trees_are_empty(tmp_path: Path) -> None:
    root = node(tmp_path)
    assert pci_path("0000:77:00.0", root) == ()
    assert pci_path("garbage", root) == ()
    assert pci_path(nvml_id("gpu0"), str(tmp_path / "absent")) == ()
    links = tmp_path / "bus" / "pci" / "devices"
    # A link that resolves to another device is not that device's ancestry.
    (links / "0000:55:00.0").symlink_to(tmp_path / "devices" / Path(*LAYOUT["gpu1"]))
    assert pci_path("0000:55:00.0", root) == ()
    (links / "0000:56:00.0").symlink_to(tmp_path / "nowhere")
    assert pci_path("0000:56:00.0", root) == ()


def test_numa_node(tmp_path: Path) -> None:
    root = node(tmp_path)
    assert numa_node(nvml_id("gpu0"), root) == 0
    assert numa_node(nvml_id("gpu7"), root) == 1
    assert numa_node("0000:77:00.0", root) is None
    pcie_tree(tmp_path, {"x": ("pci0000:e0", "0000:e0:01.0", "0000:e1:00.0")})  # -1
    assert numa_node("0000:e1:00.0", root) is None
    (tmp_path / "devices" / "pci0000:e0" / "0000:e0:01.0" / "0000:e1:00.0" / "numa_node").write_text("zz")
    assert numa_node("0000:e1:00.0", root) is None


def test_parse_pci_path() -> None:
    p = "/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0"
    assert parse_pci_path(p) == tuple(p.split("/")[3:])
    assert parse_pci_path(p + "/infiniband/mlx5_0") == tuple(p.split("/")[3:])
    assert parse_pci_path("/sys/devices/pci0000:15") == ()
    assert parse_pci_path("/sys/devices/virtual/net/lo") == ()
    assert parse_pci_path("") == ()


def kind(a: str, b: str) -> str:
    return link_kind(LAYOUT[a], LAYOUT[b], EIGHT_GPU_NUMA[LAYOUT[a][0]], EIGHT_GPU_NUMA[LAYOUT[b][0]])


def test_eight_gpu_node_matrix() -> None:
    """As `nvidia-smi topo -m` prints such a node: PIX under a switch (GPU-GPU and
    GPU-NIC), NODE between the two switches of a socket, SYS across sockets."""
    names = [f"gpu{i}" for i in range(8)] + [f"mlx5_{i}" for i in range(4)]
    switch = {n: LAYOUT[n][2] for n in names}
    for a, b in itertools.product(names, names):
        want = (
            "X" if a == b
            else "PIX" if switch[a] == switch[b]
            else "NODE" if EIGHT_GPU_NUMA[LAYOUT[a][0]] == EIGHT_GPU_NUMA[LAYOUT[b][0]]
            else "SYS"
        )
        assert kind(a, b) == want, (a, b)
    assert kind("gpu0", "gpu1") == "PIX" and kind("gpu1", "mlx5_0") == "PIX"
    assert kind("gpu1", "gpu2") == "NODE" and kind("gpu3", "gpu4") == "SYS"


H = "pci0000:00"


def test_two_root_ports_of_one_host_bridge_are_phb() -> None:
    a = (H, "0000:00:01.0", "0000:01:00.0")
    b = (H, "0000:00:03.0", "0000:02:00.0")
    assert link_kind(a, b, 0, 0) == "PHB"
    assert link_kind(a, b, None, None) == "PHB"  # one root complex needs no NUMA answer


def test_cascaded_switches_are_pxb_and_the_lowest_switch_pix() -> None:
    up = (H, "0000:00:01.0", "0000:01:00.0")  # root port, first switch's upstream port
    g1 = (*up, "0000:02:00.0", "0000:03:00.0", "0000:04:00.0", "0000:05:00.0")
    g2 = (*up, "0000:02:00.0", "0000:03:00.0", "0000:04:01.0", "0000:06:00.0")
    g3 = (*up, "0000:02:01.0", "0000:07:00.0", "0000:08:00.0", "0000:09:00.0")
    g4 = (*up, "0000:02:02.0", "0000:0a:00.0")  # directly under the first switch
    assert link_kind(g1, g2, 0, 0) == "PIX"
    assert link_kind(g1, g3, 0, 0) == "PXB"
    assert link_kind(g1, g4, 0, 0) == "PXB"


def test_functions_of_one_card_are_pix() -> None:
    a = (H, "0000:00:01.0", "0000:01:00.0")
    b = (H, "0000:00:01.0", "0000:01:00.1")  # second port of a dual-port HCA
    assert link_kind(a, b, 0, 0) == "PIX"


def test_unknown() -> None:
    a = ("pci0000:00", "0000:00:01.0", "0000:01:00.0")
    b = ("pci0000:80", "0000:80:01.0", "0000:81:00.0")
    assert link_kind(a, b, None, 0) == ""  # two host bridges, NUMA unknown: not a guess
    assert link_kind(a, b, 0, 0) == "NODE" and link_kind(a, b, 0, 1) == "SYS"
    assert link_kind((), b, 0, 0) == "" and link_kind(a, (), 0, 0) == ""


@given(st.text(alphabet="/pci0123456789abcdef:.x", max_size=200))
def test_parse_pci_path_is_total(text: str) -> None:
    path = parse_pci_path(text)
    assert path == () or (path[0].startswith("pci") and len(path) >= 2)


@given(st.text(max_size=40))
def test_sysfs_name_is_total(text: str) -> None:
    name = sysfs_name(text)
    assert name == "" or name == name.lower()


@given(
    st.lists(st.sampled_from(["pci0000:00", "0000:00:01.0", "0000:01:00.0", "x"]), max_size=6),
    st.lists(st.sampled_from(["pci0000:00", "0000:00:01.0", "0000:02:00.0", "y"]), max_size=6),
    st.none() | st.integers(-1, 3),
    st.none() | st.integers(-1, 3),
)
def test_link_kind_is_total(a: list[str], b: list[str], na: int | None, nb: int | None) -> None:
    assert link_kind(tuple(a), tuple(b), na, nb) in ("", "X", "PIX", "PXB", "PHB", "NODE", "SYS")

"""Build fake /sys/class/infiniband trees in a folder."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

STATES = {"ACTIVE": "4: ACTIVE", "DOWN": "1: DOWN", "INIT": "2: INIT"}
PHYS = {"ACTIVE": "5: LinkUp", "DOWN": "3: Disabled", "INIT": "5: LinkUp"}
RATES = {200: "200 Gb/sec (4X HDR)", 400: "400 Gb/sec (4X NDR)", 100: "100 Gb/sec (2X HDR)"}


def add_hca(
    root: Path,
    name: str,
    *,
    states: tuple[str, ...] = ("ACTIVE",),
    rate: int = 200,
    link_layer: str = "InfiniBand",
    guid: str = "",
    prefix: str = "fe80:0000:0000:0000",
) -> Path:
    """One HCA with ports 1..n in the given states ("ACTIVE", "DOWN", "INIT")."""
    hca = root / name
    (hca / "ports").mkdir(parents=True, exist_ok=True)
    num = int(name.rsplit("_", 1)[-1]) if name.rsplit("_", 1)[-1].isdigit() else 0
    (hca / "node_guid").write_text((guid or f"0c42:a103:00{num:02x}:1a2b") + "\n")
    for n, state in enumerate(states, start=1):
        port = hca / "ports" / str(n)
        (port / "gids").mkdir(parents=True, exist_ok=True)
        (port / "state").write_text(STATES[state] + "\n")
        (port / "phys_state").write_text(PHYS[state] + "\n")
        (port / "rate").write_text(RATES.get(rate, f"{rate} Gb/sec (4X)") + "\n")
        (port / "link_layer").write_text(link_layer + "\n")
        (port / "gids" / "0").write_text(f"{prefix}:0e42:a1ff:fe03:{num:04x}\n")
    return hca


def ib_tree(root: Path, n: int = 4, **kw: object) -> Path:
    """mlx5_0..mlx5_{n-1}, one active 200 Gb/s InfiniBand port each."""
    for i in range(n):
        add_hca(root, f"mlx5_{i}", **kw)  # type: ignore[arg-type]
    return root


# --- PCIe trees: /sys/devices/pci<dddd:bb>/... and the /sys/bus/pci/devices links ------


def pcie_tree(
    root: Path, layout: dict[str, tuple[str, ...]], numa: dict[str, int] | None = None
) -> dict[str, tuple[str, ...]]:
    """A fake /sys under `root` holding the PCIe devices of `layout`.

    `layout` maps a name ("gpu0", "mlx5_0") to its ancestry, host bridge first:
    ("pci0000:17", "0000:17:01.0", "0000:18:00.0", "0000:19:00.0", "0000:1a:00.0").
    Every component becomes a real directory under root/devices, every PCI device on the
    way (bridges too) a relative symlink root/bus/pci/devices/<id> -> ../../../devices/...,
    as Linux has them, with a `numa_node` file from `numa` (host bridge -> node; -1 where
    absent). Returns `layout`, for chaining.
    """
    numa = numa or {}
    links = root / "bus" / "pci" / "devices"
    links.mkdir(parents=True, exist_ok=True)
    for path in layout.values():
        node = numa.get(path[0], -1)
        for depth in range(1, len(path)):
            dev = root / "devices" / Path(*path[: depth + 1])
            dev.mkdir(parents=True, exist_ok=True)
            (dev / "numa_node").write_text(f"{node}\n")
            link = links / path[depth]
            if not link.is_symlink():
                link.symlink_to(Path("..", "..", "..", "devices", *path[: depth + 1]))
    return layout


def hca_device(ib_root: Path, hca: str, sys_root: Path, bus_id: str) -> None:
    """Point ib_root/<hca>/device at the PCI device `bus_id` of a pcie_tree, as Linux does."""
    target = (sys_root / "bus" / "pci" / "devices" / bus_id).resolve()
    (ib_root / hca).mkdir(parents=True, exist_ok=True)
    (ib_root / hca / "device").symlink_to(target)


def _switch(host: str, root_port: str, bus: int, ends: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """One PCIe switch behind `root_port`: upstream port on `bus`, downstream ports on
    bus+1 (one per device), the devices on bus+2, bus+3, ... (DFS numbering, as the BIOS
    assigns it)."""
    dom = host[3:7]
    up = f"{dom}:{bus:02x}:00.0"
    out = {}
    for i, name in enumerate(ends):
        down = f"{dom}:{bus + 1:02x}:{i:02x}.0"
        out[name] = (host, root_port, up, down, f"{dom}:{bus + 2 + i:02x}:00.0")
    return out


# An 8-GPU PCIe node as vendors build them (e.g. 8x L40S or H100 PCIe in a 4U server):
# two sockets, two host bridges each, one PCIe switch per host bridge, 2 GPUs + 1 HCA
# under each switch.
EIGHT_GPU_NUMA = {"pci0000:15": 0, "pci0000:37": 0, "pci0000:97": 1, "pci0000:b9": 1}


def eight_gpu_layout() -> dict[str, tuple[str, ...]]:
    layout: dict[str, tuple[str, ...]] = {}
    for s, (host, bus) in enumerate(
        (("pci0000:15", 0x16), ("pci0000:37", 0x38), ("pci0000:97", 0x98), ("pci0000:b9", 0xBA))
    ):
        rp = f"0000:{int(host[-2:], 16):02x}:01.0"
        layout |= _switch(host, rp, bus, (f"gpu{2 * s}", f"gpu{2 * s + 1}", f"mlx5_{s}"))
    return layout


def hca_nodes(root: Path, names: Sequence[str], hcas: Sequence[str], *, gpus: int = 2,
              discovery: Mapping[str, Any] | None = None, **extra: Any) -> dict[str, dict[str, Any]]:
    """Agent config overrides (Cluster.start_agent's) for the nodes `names`: each with the
    HCAs `hcas` ACTIVE in a fake sysfs under <root>/ib/<node>, all in fabric ib-a, and
    `gpus` simulated GPUs; `discovery` adds to the discovery table, `extra` to the rest."""
    nodes: dict[str, dict[str, Any]] = {}
    for name in names:
        ib = root / "ib" / name
        for hca in hcas:
            add_hca(ib, hca)
        nodes[name] = {"discovery": {"ib_root": str(ib), "simulated_gpus": gpus, **(discovery or {})},
                       "fabrics": [{"name": "ib-a", "hcas": list(hcas)}], **extra}
    return nodes

"""Build fake /sys/class/infiniband trees in a folder."""

from __future__ import annotations

from pathlib import Path

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

"""Write fake `nvidia-smi` executables that print real output shapes.

Each helper writes `<folder>/nvidia-smi` (a Python script run by this interpreter) and
returns its path. It answers `--query-gpu=... --format=csv,noheader,nounits` and
`topo -m` the way the real tool does; anything else exits 0 with no output.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

H100 = "NVIDIA H100 80GB HBM3"
L40S = "NVIDIA L40S"
H100_BUS = ["18", "2A", "3A", "5D", "9A", "AB", "BA", "DB"]
L40S_BUS = ["01", "41", "81", "C1"]

LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""  # noqa: E501


def uuid(i: int) -> str:
    return f"GPU-{i:08x}-1111-2222-3333-{i:012x}"


def query_line(i: int, name: str, bus: str, total: int, free: int, cap: str) -> str:
    return f"{i}, {uuid(i)}, {name}, {total}, {free}, 00000000:{bus}:00.0, {cap}"


def topo_matrix(cells: list[list[str]], numa: list[str], nics: int = 0) -> str:
    """`topo -m` text: GPU rows and NIC columns/rows, affinity columns, the legend."""
    n = len(cells)
    head = [f"GPU{i}" for i in range(n)] + [f"NIC{k}" for k in range(nics)]
    head += ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"]
    lines = ["\t" + "\t".join(head)]
    for i in range(n):
        cpu = "0-55,112-167" if numa[i] == "0" else "56-111,168-223"
        row = [f" {c} " if c == "X" else c for c in cells[i]] + ["PXB"] * nics
        lines.append(f"GPU{i}\t" + "\t".join(row) + f"\t{cpu}\t{numa[i]}\t\tN/A")
    for k in range(nics):
        row = ["PXB"] * n + [" X " if j == k else "SYS" for j in range(nics)]
        lines.append(f"NIC{k}\t" + "\t".join(row))
    text = "\n".join(lines) + "\n" + LEGEND
    if nics:
        text += "\nNIC Legend:\n\n" + "".join(f"  NIC{k}: mlx5_{k}\n" for k in range(nics))
    return text


def write_script(
    folder: Path, query: str, topo: str, *, rc: int = 0, stderr: str = "", name: str = "nvidia-smi"
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"QUERY = {query!r}\nTOPO = {topo!r}\nRC = {rc!r}\nERR = {stderr!r}\n"
        "args = sys.argv[1:]\n"
        "if ERR:\n    sys.stderr.write(ERR)\n"
        "if RC:\n    sys.exit(RC)\n"
        "if args[:2] == ['topo', '-m']:\n    sys.stdout.write(TOPO)\n"
        "elif any(a.startswith('--query-gpu=') for a in args):\n    sys.stdout.write(QUERY)\n"
    )
    os.chmod(path, 0o755)
    return path


def nvlink_board(folder: Path, nics: int = 4) -> Path:
    """An 8-GPU H100 HGX board: every pair NV18, NUMA 0 for GPUs 0-3, 1 for 4-7.

    Listed by nvidia-smi in index order, which is PCI order."""
    query = "".join(query_line(i, H100, H100_BUS[i], 81559, 81000 - i, "9.0") + "\n" for i in range(8))
    cells = [["X" if i == j else "NV18" for j in range(8)] for i in range(8)]
    numa = ["0"] * 4 + ["1"] * 4
    return write_script(folder, query, topo_matrix(cells, numa, nics))


def pcie_box(folder: Path) -> Path:
    """A 4-GPU L40S box on PCIe: no NVLink, two per socket."""
    query = "".join(query_line(i, L40S, L40S_BUS[i], 46068, 45000, "8.9") + "\n" for i in range(4))
    lvl = {(0, 1): "NODE", (2, 3): "NODE"}
    cells = [["X" if i == j else lvl.get((min(i, j), max(i, j)), "SYS") for j in range(4)] for i in range(4)]
    return write_script(folder, query, topo_matrix(cells, ["0", "0", "1", "1"]))


def mixed_board(folder: Path) -> Path:
    """4 A100 PCIe cards bridged in pairs (NV12 between 0-1 and 2-3, SYS across)."""
    query = "".join(
        query_line(i, "NVIDIA A100 80GB PCIe", L40S_BUS[i], 81920, 81000, "8.0") + "\n" for i in range(4)
    )
    pairs = {(0, 1), (2, 3)}
    cells = [
        ["X" if i == j else ("NV12" if (min(i, j), max(i, j)) in pairs else "SYS") for j in range(4)]
        for i in range(4)
    ]
    return write_script(folder, query, topo_matrix(cells, ["0", "0", "1", "1"], nics=2))


def failing(folder: Path) -> Path:
    """The driver/library mismatch every operator has met: exit 18, reason on stdout+stderr."""
    msg = "Failed to initialize NVML: Driver/library version mismatch\n"
    return write_script(folder, "", "", rc=18, stderr=msg)


def garbage(folder: Path) -> Path:
    """Exit 0 but output that is no CSV of GPUs."""
    return write_script(folder, "<html>segfault in libnvidia-ml</html>\n", "", stderr="warning: odd state\n")


# A fake NVML: hand it to the NVML reader in place of the pynvml module.


class FakeNVMLError(Exception):
    pass


class FakeNvml:
    """A small stand-in for pynvml: GPUs by bus id, NVLinks as (remote bus id) lists."""

    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18

    def __init__(
        self,
        buses: list[str],
        links: dict[int, list[str]] | None = None,
        numa: list[int] | None = None,
        *,
        numa_api: bool = True,
        fail_init: bool = False,
    ) -> None:
        self.buses = buses
        self.links = links or {}
        self.numa = numa
        self.numa_api = numa_api
        self.fail_init = fail_init
        self.inits = 0
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise FakeNVMLError("NVML Shared Library Not Found")
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.buses)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h:04d}"

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA A100-SXM4-80GB"  # older pynvml returns bytes

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(total=80 * 1024**3, free=79 * 1024**3, used=1024**3)

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return SimpleNamespace(busId=self.buses[h].encode())

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        return (8, 0)

    def nvmlDeviceGetNumaNodeId(self, h: int) -> int:
        if not self.numa_api or self.numa is None:
            raise FakeNVMLError("Not Supported")  # GPUs and drivers before R535
        return self.numa[h]

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        if link >= len(self.links.get(h, [])):
            raise FakeNVMLError("Not Supported")
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> Any:
        return SimpleNamespace(busId=self.links[h][link])


BUSES = ["00000000:07:00.0", "00000000:0F:00.0", "00000000:47:00.0", "00000000:4E:00.0"]


def legacy_driver(folder: Path) -> Path:
    """A pre-R510 driver: refuses the compute_cap field, answers without it."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = "".join(
        query_line(i, "Tesla V100-SXM2-32GB", L40S_BUS[i], 32510, 32000, "")[:-2] + "\n" for i in range(2)
    )
    topo = topo_matrix([["X", "NV2"], ["NV2", "X"]], ["0", "0"])
    path = folder / "nvidia-smi"
    path.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"ROWS = {rows!r}\nTOPO = {topo!r}\n"
        "args = sys.argv[1:]\n"
        "if args[:2] == ['topo', '-m']:\n    sys.stdout.write(TOPO)\n"
        "elif any('compute_cap' in a for a in args):\n"
        "    print('Field \"compute_cap\" is not a valid field to query.')\n"
        "    sys.exit(2)\n"
        "else:\n    sys.stdout.write(ROWS)\n"
    )
    os.chmod(path, 0o755)
    return path

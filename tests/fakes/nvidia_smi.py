"""Write fake `nvidia-smi` executables that print real output shapes.

Each helper writes `<folder>/nvidia-smi` (a Python script run by this interpreter) and
returns its path. It answers `--query-gpu=... --format=csv,noheader,nounits` and
`topo -m` the way the real tool does; anything else exits 0 with no output.
"""

from __future__ import annotations

import ctypes
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
    folder: Path,
    query: str,
    topo: str,
    *,
    rc: int = 0,
    stderr: str = "",
    name: str = "nvidia-smi",
    query_rc: int = 0,
) -> Path:
    """`rc`: every call prints `stderr` only and exits with it (a broken driver).
    `query_rc`: the query prints its lines and then exits with it (nvidia-smi does so when
    it could read some GPUs but not all)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"QUERY = {query!r}\nTOPO = {topo!r}\nRC = {rc!r}\nERR = {stderr!r}\n"
        f"QUERY_RC = {query_rc!r}\n"
        "args = sys.argv[1:]\n"
        "if ERR:\n    sys.stderr.write(ERR)\n"
        "if RC:\n    sys.exit(RC)\n"
        "if args[:2] == ['topo', '-m']:\n    sys.stdout.write(TOPO)\n"
        "elif any(a.startswith('--query-gpu=') for a in args):\n"
        "    sys.stdout.write(QUERY)\n    sys.exit(QUERY_RC)\n"
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


def one_bad_line(folder: Path) -> Path:
    """4 H100s of which nvidia-smi cannot read the third: its line is an error text, and
    the query exits 15 (as nvidia-smi does when one GPU is lost) with the reason on stderr."""
    rows = [query_line(i, H100, H100_BUS[i], 81559, 81000, "9.0") for i in range(4)]
    rows[2] = "Unable to determine the device handle for GPU0000:3A:00.0: GPU is lost"
    cells = [["X" if i == j else "NV18" for j in range(4)] for i in range(4)]
    return write_script(folder, "\n".join(rows) + "\n", topo_matrix(cells, ["0", "0", "1", "1"]),
                        stderr="Unable to determine the device handle for gpu 0000:3A:00.0: GPU is lost.\n",
                        query_rc=15)


def garbage(folder: Path) -> Path:
    """Exit 0 but output that is no CSV of GPUs."""
    return write_script(folder, "<html>segfault in libnvidia-ml</html>\n", "", stderr="warning: odd state\n")


# A fake NVML: hand it to the NVML reader in place of the pynvml module.

# pynvml's return codes, as the real module names them.
NVML_SUCCESS = 0
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999


class FakeNVMLError(Exception):
    """pynvml.NVMLError's shape: `.value` is the NVML return code, str() its text.

    Built from a code (`FakeNVMLError(NVML_ERROR_GPU_IS_LOST)`) or, as older tests do,
    from the text (`FakeNVMLError("Not Supported")`), which maps back to its code."""

    TEXT = {
        NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
        NVML_ERROR_TIMEOUT: "Timeout",
        NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
        NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_UNKNOWN: "Unknown Error",
    }

    def __init__(self, value: int | str) -> None:
        if isinstance(value, str):
            text = value
            code = {t: c for c, t in self.TEXT.items()}.get(value, NVML_ERROR_UNKNOWN)
        else:
            code, text = value, self.TEXT.get(value, f"NVML Error with code {value}")
        super().__init__(text)
        self.value = code


class FakeFabricInfo(ctypes.Structure):
    """The two fields of pynvml's c_nvmlGpuFabricInfo_t that llmgw reads."""

    _fields_ = [("status", ctypes.c_uint), ("state", ctypes.c_uint)]


def _unsupported() -> FakeNVMLError:
    return FakeNVMLError(NVML_ERROR_NOT_SUPPORTED)


class FakeNvml:
    """A small stand-in for pynvml: GPUs by bus id, NVLinks as (remote bus id) lists.

    Every option is per NVML index (0 .. len(buses)-1); what is not said is a healthy GPU
    with no processes and no NVSwitch fabric (fabric calls answer Not Supported):

    - `links`: index -> remote PCI bus id of each active NVLink (a switch's or a GPU's).
    - `numa`: NUMA node per index; `numa_api=False`: the NUMA call is Not Supported.
    - `fail_init`: nvmlInit raises (no driver).
    - `uuids`: the UUID per index (default GPU-0000, GPU-0001, ...); give them out of
      sorted order to check that nothing assumes index order is UUID order.
    - `lost`: indices whose nvmlDeviceGetHandleByIndex raises GPU_IS_LOST.
    - `errors`: (index, NVML function name) -> NVML error code that call raises, e.g.
      `{(2, "nvmlDeviceGetMemoryInfo"): NVML_ERROR_GPU_IS_LOST}` (lost mid-read).
    - `mig`: indices whose current MIG mode is enabled.
    - `ecc`: index -> volatile uncorrected ECC error count.
    - `remap_pending`, `remap_failed`: indices with a pending / failed row remap.
    - `retired_pending`: indices with retired pages pending a reset.
    - `recovery`: index -> NVML_GPU_RECOVERY_ACTION_* read through nvmlDeviceGetFieldValues
      (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION); an index not given answers NONE, and with
      `recovery_api=False` the field value carries Not Supported (drivers before R550).
    - `fabric`: index -> (NVML_GPU_FABRIC_STATE_*, NVML return code of the registration),
      e.g. `{0: (FakeNvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS, NVML_SUCCESS)}`.
    - `health_api=False`: every health call (MIG, ECC, remap, retired pages, fabric) is
      Not Supported, as on consumer boards and old drivers.
    - `processes`: index -> [(pid, used bytes or None)] compute processes (None: NVML
      does not say, as under MIG or without permission).
    - `process_names`: pid -> what nvmlSystemGetProcessName answers.
    - `xids`: (index, Xid) events queued for the event set, delivered in order by
      nvmlEventSetWait_v2 (which answers Timeout when none is left). Index -1: an event
      whose device NVML cannot name (a handle nothing registered, whose UUID read fails).
    - `events_api=False`: nvmlEventSetCreate is Not Supported.
    - `xid_unsupported`: indices on which nvmlDeviceRegisterEvents is Not Supported.
    """

    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18
    NVML_SUCCESS = NVML_SUCCESS
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_TIMEOUT = NVML_ERROR_TIMEOUT
    NVML_ERROR_FUNCTION_NOT_FOUND = NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST = NVML_ERROR_GPU_IS_LOST
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_GPU_FABRIC_STATE_NOT_SUPPORTED = 0
    NVML_GPU_FABRIC_STATE_NOT_STARTED = 1
    NVML_GPU_FABRIC_STATE_IN_PROGRESS = 2
    NVML_GPU_FABRIC_STATE_COMPLETED = 3
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
    nvmlEventTypeXidCriticalError = 0x8
    NVMLError = FakeNVMLError
    c_nvmlGpuFabricInfo_t = FakeFabricInfo

    def __init__(
        self,
        buses: list[str],
        links: dict[int, list[str]] | None = None,
        numa: list[int] | None = None,
        *,
        numa_api: bool = True,
        fail_init: bool = False,
        uuids: list[str] | None = None,
        lost: set[int] | frozenset[int] = frozenset(),
        errors: dict[tuple[int, str], int] | None = None,
        mig: set[int] | frozenset[int] = frozenset(),
        ecc: dict[int, int] | None = None,
        remap_pending: set[int] | frozenset[int] = frozenset(),
        remap_failed: set[int] | frozenset[int] = frozenset(),
        retired_pending: set[int] | frozenset[int] = frozenset(),
        fabric: dict[int, tuple[int, int]] | None = None,
        recovery: dict[int, int] | None = None,
        recovery_api: bool = True,
        health_api: bool = True,
        processes: dict[int, list[tuple[int, int | None]]] | None = None,
        process_names: dict[int, str] | None = None,
        xids: list[tuple[int, int]] | None = None,
        events_api: bool = True,
        xid_unsupported: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        self.buses = buses
        self.links = links or {}
        self.numa = numa
        self.numa_api = numa_api
        self.fail_init = fail_init
        self.uuids = uuids
        self.lost = set(lost)
        self.errors = dict(errors or {})
        self.mig = set(mig)
        self.ecc = dict(ecc or {})
        self.remap_pending = set(remap_pending)
        self.remap_failed = set(remap_failed)
        self.retired_pending = set(retired_pending)
        self.fabric = dict(fabric or {})
        self.recovery = dict(recovery or {})
        self.recovery_api = recovery_api
        self.health_api = health_api
        self.processes = dict(processes or {})
        self.process_names = dict(process_names or {})
        self.xids = list(xids or [])
        self.events_api = events_api
        self.xid_unsupported = set(xid_unsupported)
        self.inits = 0
        self.shutdowns = 0
        self.registered: list[tuple[int, int]] = []  # (index, event types) registered
        self.event_sets_freed = 0
        self.waits = 0

    def _check(self, h: int, call: str) -> None:
        code = self.errors.get((h, call))
        if code is not None:
            raise FakeNVMLError(code)

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise FakeNVMLError("NVML Shared Library Not Found")
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.buses)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if i in self.lost:
            raise FakeNVMLError(NVML_ERROR_GPU_IS_LOST)
        self._check(i, "nvmlDeviceGetHandleByIndex")
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        if h == -1:
            raise FakeNVMLError(NVML_ERROR_INVALID_ARGUMENT)
        self._check(h, "nvmlDeviceGetUUID")
        return self.uuids[h] if self.uuids is not None else f"GPU-{h:04d}"

    def nvmlDeviceGetName(self, h: int) -> bytes:
        self._check(h, "nvmlDeviceGetName")
        return b"NVIDIA A100-SXM4-80GB"  # older pynvml returns bytes

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        self._check(h, "nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=80 * 1024**3, free=79 * 1024**3, used=1024**3)

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        self._check(h, "nvmlDeviceGetPciInfo")
        return SimpleNamespace(busId=self.buses[h].encode())

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        self._check(h, "nvmlDeviceGetCudaComputeCapability")
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

    # Health.

    def _health(self, h: int, call: str) -> None:
        if not self.health_api:
            raise _unsupported()
        self._check(h, call)

    def nvmlDeviceGetMigMode(self, h: int) -> list[int]:
        self._health(h, "nvmlDeviceGetMigMode")
        on = 1 if h in self.mig else 0
        return [on, on]

    def nvmlDeviceGetTotalEccErrors(self, h: int, error_type: int, counter_type: int) -> int:
        self._health(h, "nvmlDeviceGetTotalEccErrors")
        if (error_type, counter_type) != (self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, self.NVML_VOLATILE_ECC):
            return 0
        return self.ecc.get(h, 0)

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        self._health(h, "nvmlDeviceGetRemappedRows")
        pending, failed = int(h in self.remap_pending), int(h in self.remap_failed)
        return (0, pending + failed, pending, failed)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: int) -> int:
        self._health(h, "nvmlDeviceGetRetiredPagesPendingStatus")
        return int(h in self.retired_pending)

    def nvmlDeviceGetGpuFabricInfo(self, h: int, info: Any) -> int:
        self._health(h, "nvmlDeviceGetGpuFabricInfo")
        if h not in self.fabric:
            raise _unsupported()  # no NVSwitch fabric: not Hopper-with-NVSwitch
        state, status = self.fabric[h]
        target = info._obj  # what ctypes.byref wraps
        target.state, target.status = state, status
        return NVML_SUCCESS

    def nvmlDeviceGetFieldValues(self, h: int, field_ids: list[int]) -> list[Any]:
        """pynvml's shape: one c_nvmlFieldValue_t-like value per id, each with its own
        nvmlReturn; only the recovery action is known here."""
        self._health(h, "nvmlDeviceGetFieldValues")
        out = []
        for fid in field_ids:
            known = fid == self.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and self.recovery_api
            out.append(SimpleNamespace(
                fieldId=fid, nvmlReturn=NVML_SUCCESS if known else NVML_ERROR_NOT_SUPPORTED,
                value=SimpleNamespace(uiVal=self.recovery.get(h, 0) if known else 0)))
        return out

    # Processes.

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        self._check(h, "nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.processes.get(h, [])]

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        if pid not in self.process_names:
            raise FakeNVMLError(NVML_ERROR_NO_PERMISSION)
        return self.process_names[pid]

    # Events (Xid).

    def nvmlEventSetCreate(self) -> Any:
        if not self.events_api:
            raise _unsupported()
        return SimpleNamespace(kind="event set")

    def nvmlDeviceRegisterEvents(self, h: int, types: int, event_set: Any) -> None:
        if h in self.xid_unsupported:
            raise _unsupported()
        self.registered.append((h, types))

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any:
        self.waits += 1
        registered = {h for h, _ in self.registered}
        while self.xids:
            h, xid = self.xids.pop(0)
            if h in registered or h == -1:
                return SimpleNamespace(device=h, eventType=self.nvmlEventTypeXidCriticalError,
                                       eventData=xid, gpuInstanceId=0, computeInstanceId=0)
        raise FakeNVMLError(NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, event_set: Any) -> None:
        self.event_sets_freed += 1


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

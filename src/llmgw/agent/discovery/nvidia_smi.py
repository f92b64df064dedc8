"""Pure parsers of `nvidia-smi` output: `--query-gpu` CSV and the `topo -m` matrix."""

from __future__ import annotations

import re
from collections.abc import Sequence

from attrs import evolve, field, frozen

from llmgw.errors import DiscoveryError
from llmgw.model.inventory import Gpu

QUERY_FIELDS = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.free",
    "pci.bus_id",
    "compute_cap",
)
QUERY_ARGS = (
    f"--query-gpu={','.join(QUERY_FIELDS)}",
    "--format=csv,noheader,nounits",
)
# Drivers before R510 know no compute_cap field and refuse the whole query for it.
LEGACY_QUERY_ARGS = (
    f"--query-gpu={','.join(QUERY_FIELDS[:-1])}",
    "--format=csv,noheader,nounits",
)
TOPO_ARGS = ("topo", "-m")

_BUS_ID = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):"
    r"(?P<dev>[0-9a-fA-F]{1,2})\.(?P<fn>[0-7])$"
)
_NV = re.compile(r"^NV(\d+)$")
_GPU = re.compile(r"^GPU(\d+)$")


class GpuOutputError(DiscoveryError):
    """nvidia-smi (or NVML) said something that cannot be read as GPUs."""


def normalise_bus_id(raw: str) -> str:
    """Canonical PCI bus id, as nvidia-smi prints it: `00000000:1B:00.0`.

    Accepts the sysfs form (`0000:1b:00.0`), NVML's, and no domain at all (`1b:00.0`).
    """
    m = _BUS_ID.match(raw.strip())
    if m is None:
        raise GpuOutputError(f"not a PCI bus id: {_quote(raw)}")
    domain = int(m["domain"] or "0", 16)
    return f"{domain:08X}:{int(m['bus'], 16):02X}:{int(m['dev'], 16):02X}.{m['fn']}"


def sysfs_bus_id(bus_id: str) -> str:
    """The name of the device under /sys/bus/pci/devices: `0000:1b:00.0`."""
    canon = normalise_bus_id(bus_id)
    domain, rest = canon.split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


# A bad line is quoted in its warning up to this length, and at most this many bad lines
# are named: nvidia-smi's output is not ours to copy whole into the inventory.
LINE_MAX = 120
BAD_LINES_MAX = 8


def _quote(text: str) -> str:
    """`text` quoted, at most LINE_MAX characters as quoted: a control or unprintable
    character grows up to tenfold in repr, so the bound is on the quote, not the input."""
    quoted = repr(text[: LINE_MAX + 1])
    return quoted if len(quoted) <= LINE_MAX else quoted[:LINE_MAX] + "…"


def _int(value: str, what: str) -> int:
    if value in ("[N/A]", "N/A", "[Not Supported]"):
        return 0
    try:
        return int(float(value))
    except (ValueError, OverflowError):
        raise GpuOutputError(f"bad {what} {_quote(value)}") from None


def _parse_line(line: str) -> Gpu:
    cells = [c.strip() for c in line.split(",")]
    if len(cells) == len(QUERY_FIELDS) - 1:  # LEGACY_QUERY_ARGS: no compute_cap
        cells.append("")
    if len(cells) != len(QUERY_FIELDS):
        raise GpuOutputError(f"expected {len(QUERY_FIELDS)} fields, got {len(cells)}")
    index, uuid, name, total, free, bus, cap = cells
    if not uuid.startswith(("GPU-", "MIG-")):
        raise GpuOutputError(f"bad GPU UUID {_quote(uuid)}")
    return Gpu(
        index=_int(index, "index"),
        uuid=uuid,
        name=name,
        memory_total=_int(total, "memory.total"),
        memory_free=_int(free, "memory.free"),
        pci_bus_id=normalise_bus_id(bus[:LINE_MAX]),
        compute_capability="" if cap in ("[N/A]", "N/A") else cap,
    )


@frozen
class QueryReading:
    """The GPUs of every good line, and a warning for each bad one (bounded)."""

    gpus: tuple[Gpu, ...] = ()
    warnings: tuple[str, ...] = ()


def parse_query_gpu(text: str) -> QueryReading:
    """Parse `nvidia-smi --query-gpu=<QUERY_FIELDS> --format=csv,noheader,nounits`.

    Every good line is kept: nvidia-smi prints an error text in place of a GPU it cannot
    read, and one such GPU must not hide the others. A bad line, or a second line for a
    UUID already read, becomes a warning naming it. NVLink peers and NUMA node are left
    empty: they come from `topo -m` or sysfs. Never raises.
    """
    gpus: list[Gpu] = []
    bad: list[str] = []
    seen: set[str] = set()
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            gpu = _parse_line(line)
            if gpu.uuid in seen:
                raise GpuOutputError(f"UUID {_quote(gpu.uuid)} listed twice")
        except GpuOutputError as exc:
            bad.append(f"unreadable nvidia-smi line {_quote(line)}: {exc}")
            continue
        seen.add(gpu.uuid)
        gpus.append(gpu)
    if len(bad) > BAD_LINES_MAX:
        bad = [*bad[:BAD_LINES_MAX], f"and {len(bad) - BAD_LINES_MAX} more unreadable nvidia-smi lines"]
    return QueryReading(tuple(gpus), tuple(bad))


@frozen
class Topology:
    """What `nvidia-smi topo -m` says, keyed by the GPU index of its rows."""

    # GPU index -> {peer GPU index -> number of NVLinks}
    nvlinks: dict[int, dict[int, int]] = field(factory=dict)
    # GPU index -> NUMA node (None: "N/A" or no such column)
    numa: dict[int, int | None] = field(factory=dict)


def _split_row(line: str) -> list[str]:
    if "\t" in line:
        return [c.strip() for c in line.split("\t")]
    # Some versions pad with spaces: columns are separated by two or more.
    return [c.strip() for c in re.split(r"\s{2,}", line)]


def parse_topo(text: str) -> Topology:
    """Parse `nvidia-smi topo -m`: NV# cells between GPUs and the NUMA Affinity column.

    NIC rows and columns, CPU affinity and the legend are read past.
    """
    header: list[str] | None = None
    nvlinks: dict[int, dict[int, int]] = {}
    numa: dict[int, int | None] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = _split_row(line)
        if header is None:
            if any(_GPU.match(c) for c in cells):
                header = cells
            continue
        if line.lstrip().startswith("Legend") or cells[0].endswith(":"):
            break
        row = _GPU.match(cells[0])
        if row is None:
            continue  # a NIC row
        me = int(row[1])
        # Data rows start with the row label; the header starts with an empty cell
        # when tab-separated, or with the first column name when space-separated.
        cols = header[1:] if header and header[0] == "" else header
        values = cells[1:]
        peers: dict[int, int] = {}
        for name, value in zip(cols, values, strict=False):
            col = _GPU.match(name)
            if col is not None:
                nv = _NV.match(value)
                if nv is not None and int(col[1]) != me:
                    peers[int(col[1])] = int(nv[1])
            elif name == "NUMA Affinity":
                numa[me] = int(value) if value.isdigit() else None
        nvlinks[me] = peers
    if header is None:
        raise GpuOutputError("no GPU columns in `nvidia-smi topo -m` output")
    return Topology(nvlinks=nvlinks, numa=numa)


def apply_topology(gpus: Sequence[Gpu], topo: Topology) -> list[Gpu]:
    """Fill nvlink_peers (by UUID) and numa_node from `topo -m` into parsed GPUs."""
    by_index = {g.index: g for g in gpus}
    out = []
    for g in gpus:
        peers = {by_index[i].uuid: n for i, n in topo.nvlinks.get(g.index, {}).items() if i in by_index}
        numa = topo.numa.get(g.index, g.numa_node)
        out.append(evolve(g, nvlink_peers=peers, numa_node=numa))
    return out

"""Pure parsers of nvidia-smi output, on the text the fake scripts print."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

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
    reading = parse_query_gpu(_out(fake.nvlink_board(tmp_path), *QUERY_ARGS))
    assert reading.warnings == ()
    gpus = reading.gpus
    assert len(gpus) == 8
    g = gpus[3]
    assert g.index == 3
    assert g.uuid == fake.uuid(3)
    assert g.name == "NVIDIA H100 80GB HBM3"
    assert (g.memory_total, g.memory_free) == (81559, 80997)
    assert g.pci_bus_id == "00000000:5D:00.0"
    assert g.compute_capability == "9.0"


def test_query_gpu_garbage_is_a_warning_naming_the_line() -> None:
    reading = parse_query_gpu("<html>segfault in libnvidia-ml</html>\n")
    assert reading.gpus == ()
    assert reading.warnings == (
        "unreadable nvidia-smi line '<html>segfault in libnvidia-ml</html>': expected 7 fields, got 1",)


def test_query_gpu_keeps_the_good_lines_around_a_bad_one(tmp_path: Path) -> None:
    # Was: one line nvidia-smi could not fill (a lost GPU) made the whole query an error.
    out = subprocess.run([str(fake.one_bad_line(tmp_path)), *QUERY_ARGS], capture_output=True, text=True).stdout
    reading = parse_query_gpu(out)
    assert [g.index for g in reading.gpus] == [0, 1, 3]
    assert len(reading.warnings) == 1
    assert "'Unable to determine the device handle for GPU0000:3A:00.0: GPU is lost'" in reading.warnings[0]


def test_query_gpu_bad_lines_are_bounded() -> None:
    long_line = "x" * 5000
    reading = parse_query_gpu("\n".join([long_line] * 20 + [fake.query_line(0, "A", "18", 1, 1, "9.0")]))
    assert len(reading.gpus) == 1
    assert len(reading.warnings) == 9 and reading.warnings[-1] == "and 12 more unreadable nvidia-smi lines"
    assert all(len(w) < 300 for w in reading.warnings)


def test_query_gpu_second_line_for_a_uuid_is_a_warning() -> None:
    line = fake.query_line(0, "A", "18", 1, 1, "9.0")
    reading = parse_query_gpu(f"{line}\n{line}\n")
    assert len(reading.gpus) == 1
    assert "listed twice" in reading.warnings[0]


def test_a_warning_is_bounded_however_its_line_quotes() -> None:
    """Control and unprintable characters grow up to tenfold in a quote (found by the
    property test below): the bound is on the quoted text."""
    weird = "\x1b\U00018cd6" * 60
    reading = parse_query_gpu(f"0, GPU-{weird}, {weird}, {weird}, x{weird}, {weird}, 9.0\n{weird}")
    assert len(reading.warnings) == 2 and all(len(w) < 400 for w in reading.warnings)
    assert "…" in reading.warnings[0]


_cell = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30)
_garbage_line = st.one_of(
    st.text(max_size=200),
    st.lists(_cell, min_size=6, max_size=8).map(", ".join),
    st.tuples(st.integers(-5, 99), _cell, _cell, _cell, _cell).map(
        lambda t: f"{t[0]}, GPU-{t[1]}, {t[2]}, {t[3]}, {t[4]}, 00000000:18:00.0, 9.0"),
)


@given(st.lists(st.one_of(st.integers(0, 7).map(lambda i: ("good", i)), _garbage_line.map(lambda g: ("bad", g))),
                max_size=30))
def test_query_gpu_always_keeps_the_good_lines(lines: list[tuple[str, object]]) -> None:
    text = "\n".join(fake.query_line(int(str(x)), fake.H100, fake.H100_BUS[int(str(x))], 81559, 81000, "9.0")
                     if kind == "good" else str(x) for kind, x in lines)
    reading = parse_query_gpu(text)
    good = list(dict.fromkeys(int(str(x)) for kind, x in lines if kind == "good"))
    kept = [g.uuid for g in reading.gpus]
    # Every good line's GPU is there, in order (a garbage line may still parse as a GPU of its own).
    assert [u for u in kept if u in {fake.uuid(i) for i in good}] == [fake.uuid(i) for i in good]
    assert len(reading.warnings) <= 9
    assert all(len(w) < 400 for w in reading.warnings)


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
    gpus = apply_topology(parse_query_gpu(_out(exe, *QUERY_ARGS)).gpus, parse_topo(_out(exe, "topo", "-m")))
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
    (g,) = parse_query_gpu(line).gpus
    assert (g.memory_total, g.memory_free, g.pci_bus_id) == (0, 0, "00000009:01:00.0")

"""bench/gpu_check.py's comparison (the part that needs no GPU), on fake readings."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from attrs import evolve

from fakes import nvidia_smi as fake
from fakes.nvidia_smi import BUSES, FakeNvml
from llmgw.agent.discovery.gpus import _read_nvidia_smi
from llmgw.agent.discovery.nvml import read_nvml
from llmgw.model.inventory import GpuProcess

GIB = 1024**3


def gpu_check() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
    # It imports its sibling modules (gpu_check_steps) as a script run from bench/ would.
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", mod)
    spec.loader.exec_module(mod)
    return mod


def test_fields_cover_the_new_ones() -> None:
    assert {"compute_capability", "pci_path"} <= set(gpu_check().FIELDS)


def test_same_board_both_ways_has_no_differences(tmp_path: Path) -> None:
    gc = gpu_check()
    smi, _ = _read_nvidia_smi(str(fake.pcie_box(tmp_path)), str(tmp_path))
    assert smi is not None
    assert gc.differences(smi, smi) == []
    other = [evolve(smi[0], compute_capability="9.0", pci_path=("pci0000:00",)), *smi[1:]]
    diffs = gc.differences(smi, other)
    assert len(diffs) == 2 and "compute_capability" in diffs[0] and "pci_path" in diffs[1]


def test_processes_are_compared_with_nvidia_smis_compute_apps() -> None:
    gc = gpu_check()
    gpus = read_nvml(FakeNvml(BUSES[:2], processes={0: [(4242, 61 * GIB)]}), cmdline_of=lambda _p: "x")
    apps = gc.parse_compute_apps("GPU-0000, 4242, 62464\nNo running processes found\nGPU-0000, x, 1\n")
    assert apps == {"GPU-0000": {4242: 62464}}
    assert gc.process_differences(gpus, apps) == []
    assert gc.process_differences(gpus, {"GPU-0000": {4242: 1000}}) == [
        "GPU-0000 pid 4242 memory: NVML 62464 MiB vs nvidia-smi 1000 MiB"]
    assert gc.process_differences(gpus, {}) == ["GPU-0000 processes: NVML [4242] vs nvidia-smi []"]
    moved = [evolve(gpus[0], processes=(GpuProcess(4242, "x", 62400),)), gpus[1]]
    assert gc.process_differences(moved, apps) == []
    assert gc.parse_compute_apps("GPU-0001, 7, [N/A]\n") == {"GPU-0001": {7: 0}}

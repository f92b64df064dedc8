"""bench/gpu_check_probes.py's nvml_calls step against tests/fakes' FakeNvml: every NVML
call llmgw's readers make, as a raw table (the other two steps need torch with CUDA)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from fakes.nvidia_smi import BUSES, FakeNvml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import gpu_check_probes as probes  # noqa: E402


def test_every_reader_is_recorded_call_by_call_with_what_it_returned_or_raised(tmp_path: Path) -> None:
    nvml = FakeNvml(BUSES[:2], xids=[(1, 79)])
    out = probes.nvml_calls(nvml, str(tmp_path))  # an empty sysfs: no NUMA there either
    assert out.passed, out.notes
    f = out.figures
    assert set(f["readers"]) == {"discovery.gpus._try_nvml", "discovery.nvml.read_gpu_memory",
                                 "gpu_usage.read_usage", "xid._Watch"}
    assert {r["reader"] for r in f["calls"]} == set(f["readers"])
    uuids = [r for r in f["calls"] if r["call"] == "nvmlDeviceGetUUID"]
    assert uuids and {r["returned"] for r in uuids} == {"GPU-0000", "GPU-0001"}
    # What NVML raised is data: NUMA is Not Supported on this fake, and shown as such.
    assert f["raised_by_call"].get("nvmlDeviceGetNumaNodeId", 0) >= 2
    assert any("Not Supported" in r.get("raised", "") for r in f["calls"])
    mem = next(r for r in f["calls"] if r["call"] == "nvmlDeviceGetMemoryInfo")
    assert mem["returned"]["total"] == 80 * 1024**3  # a structure shown as its fields
    assert "(1, 79)" in f["readers"]["xid._Watch"] or "79" in f["readers"]["xid._Watch"]


def test_a_reader_that_raises_fails_the_step_and_says_which() -> None:
    class Broken(FakeNvml):
        def nvmlDeviceGetCount(self) -> Any:
            raise RuntimeError("driver gone")

    out = probes.nvml_calls(Broken(BUSES[:1]), "/nonexistent")
    assert not out.passed
    assert any("gpu_usage.read_usage raised RuntimeError: driver gone" in n for n in out.notes)
    assert not probes.nvml_calls(None, "/").passed


def test_probe_settings_are_those_the_agent_gives_a_one_gpu_probe() -> None:
    s = probes.probe_settings(29555, 60.0)
    assert (s["nnodes"], s["node_rank"], s["local_ranks"], s["master_port"]) == (1, 0, 1, 29555)
    assert s["master_addr"] == "127.0.0.1" and s["gpu_sizes"][-1] == 256 << 20

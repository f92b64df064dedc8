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


# -- cuda_numbering and preflight, with a stand-in for the GPU machine's Python ---------------


def _python(tmp: Path, body: str) -> str:
    """An executable that stands where the GPU machine's Python would: it ignores its
    arguments (`-c CODE`, the probe's path) and runs `body` (os and json imported)."""
    exe = tmp / "python"
    exe.write_text(f"#!{sys.executable}\nimport json, os\n{body}\n")
    exe.chmod(0o755)
    return str(exe)


CUDA = """uuids = ["GPU-a", "GPU-b"]
order = {UNSET: [0, 1], "0": [MAP0], "1": [MAP1]}[os.environ.get("CUDA_VISIBLE_DEVICES", UNSET)]
assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
print(json.dumps([{"index": i, "uuid": uuids[n][4:], "name": "H100", "pci": [0, n, 0]}
                  for i, n in enumerate(order)]))
"""


def _cuda(tmp: Path, map0: int, map1: int) -> str:
    return _python(tmp, CUDA.replace("UNSET", "'unset'").replace("MAP0", str(map0)).replace("MAP1", str(map1)))


def test_cuda_numbering_matches_nvml_by_uuid_also_one_device_at_a_time(tmp_path: Path) -> None:
    from gpu_check_steps import Deadline

    good = probes.cuda_numbering({0: "GPU-a", 1: "GPU-b"}, Deadline(60), python=_cuda(tmp_path, 0, 1))
    assert good.passed, good.notes
    assert good.figures["one_visible"] == {"0": "a", "1": "b"}
    # CUDA_VISIBLE_DEVICES=1 showing NVML's GPU 0: an engine given "1" would run elsewhere.
    bad = probes.cuda_numbering({0: "GPU-a", 1: "GPU-b"}, Deadline(60), python=_cuda(tmp_path, 0, 0))
    assert not bad.passed and any("CUDA_VISIBLE_DEVICES=1 shows a, NVML index 1 is GPU-b" in n for n in bad.notes)


def test_preflight_step_reads_the_probe_with_the_agents_parser_and_wants_nccl(tmp_path: Path) -> None:
    from gpu_check_steps import Deadline

    said = ('cfg = json.loads(os.environ["LLMGW_PREFLIGHT"])\n'
            'assert cfg["local_ranks"] == 1 and os.environ["CUDA_VISIBLE_DEVICES"] == "0"\n'
            'print("LLMGW_PREFLIGHT " + json.dumps({"ok": True, "backend": BACKEND, "world": 1, '
            '"results": [{"bytes": 268435456, "seconds": 0.001, "algbw_gbps": 268.0, "busbw_gbps": 0.0}]}))')
    nccl = probes.preflight_probe(29555, Deadline(60), python=_python(tmp_path, said.replace("BACKEND", '"nccl"')))
    assert nccl.passed, nccl.notes
    assert nccl.figures["backend"] == "nccl" and nccl.figures["world"] == 1
    gloo = probes.preflight_probe(29555, Deadline(60), python=_python(tmp_path, said.replace("BACKEND", '"gloo"')))
    assert not gloo.passed and "ran gloo, not nccl" in gloo.notes[0]

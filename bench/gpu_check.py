"""The GPU check (issue 11): llmgw's discovery against real NVML and nvidia-smi, compared.

Run it on a machine with NVIDIA GPUs, from a checkout with llmgw installed:

    python bench/gpu_check.py                 # discovery only: a minute at most
    python bench/gpu_check.py --real-engine   # then the real-engine tier on the GPU

It reads the GPUs both ways llmgw can (NVML through nvidia-ml-py, and nvidia-smi's query
and `topo -m`), prints what each found and every difference (UUIDs, names, memory, PCI
bus, NUMA node, NVLink peers), and exits 1 if they disagree or find nothing. With
`--real-engine` it then runs `pytest -m real_engine tests/real_engine` against the vLLM
build named by LLMGW_VLLM_VENV (a venv with vLLM's GPU build: `pip install vllm`). Nothing
in the test suite depends on this script or on a GPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

from llmgw.agent.discovery.gpus import PCI_ROOT, _read_nvidia_smi, _try_nvml, load_nvml
from llmgw.model.inventory import Gpu

FIELDS = ("uuid", "name", "memory_total", "pci_bus_id", "numa_node", "compute_capability",
          "nvlink_peers", "pci_path")
# nvidia-smi's query reads no health and no processes: NVML's are shown, and its process
# list is checked against `nvidia-smi --query-compute-apps` (process_differences).
COMPUTE_APPS_ARGS = ("--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits")
# Two reads a moment apart: a process's memory may move this much between them.
PROCESS_MEMORY_SLACK_MIB = 256


def show(source: str, gpus: list[Gpu]) -> None:
    print(f"{source}: {len(gpus)} GPU(s)")
    for g in gpus:
        peers = ",".join(f"{u[-8:]}x{n}" for u, n in sorted(g.nvlink_peers.items())) or "-"
        print(f"  {g.index} {g.uuid} {g.name} {g.memory_total} MiB bus={g.pci_bus_id} "
              f"numa={g.numa_node} nvlink={peers}")
        for p in g.problems:
            print(f"    problem: {p}")
        for proc in g.processes:
            print(f"    process: pid {proc.pid} {proc.memory} MiB {proc.command}")


def parse_compute_apps(text: str) -> dict[str, dict[int, int]]:
    """`nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory`: UUID -> {pid: MiB}
    (a memory nvidia-smi does not give, "[N/A]", reads 0; lines that do not parse are skipped)."""
    out: dict[str, dict[int, int]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 3 or not cells[1].isdigit():
            continue
        mib = int(cells[2]) if cells[2].isdigit() else 0
        out.setdefault(cells[0], {})[int(cells[1])] = mib
    return out


def process_differences(gpus: list[Gpu], apps: dict[str, dict[int, int]]) -> list[str]:
    """NVML's processes per GPU (Gpu.processes) against nvidia-smi's compute apps."""
    out = []
    for g in gpus:
        mine = {p.pid: p.memory for p in g.processes}
        theirs = apps.get(g.uuid, {})
        if set(mine) != set(theirs):
            out.append(f"{g.uuid} processes: NVML {sorted(mine)} vs nvidia-smi {sorted(theirs)}")
            continue
        for pid, mib in mine.items():
            if theirs[pid] and abs(mib - theirs[pid]) > PROCESS_MEMORY_SLACK_MIB:
                out.append(f"{g.uuid} pid {pid} memory: NVML {mib} MiB vs nvidia-smi {theirs[pid]} MiB")
    return out


def differences(a: list[Gpu], b: list[Gpu]) -> list[str]:
    by_uuid = {g.uuid: g for g in b}
    out = []
    if {g.uuid for g in a} != set(by_uuid):
        out.append(f"UUIDs differ: NVML {sorted(g.uuid for g in a)} vs nvidia-smi {sorted(by_uuid)}")
    for g in a:
        h = by_uuid.get(g.uuid)
        if h is None:
            continue
        for f in FIELDS:
            if getattr(g, f) != getattr(h, f):
                out.append(f"{g.uuid} {f}: NVML {getattr(g, f)!r} vs nvidia-smi {getattr(h, f)!r}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real-engine", action="store_true", help="then run the real-engine tier")
    args = ap.parse_args()
    smi = shutil.which("nvidia-smi")
    print("nvidia-smi:", smi or "not found")
    if smi:
        subprocess.run([smi, "-L"], check=False)
    nvml = load_nvml()
    from_nvml, why = _try_nvml(nvml, PCI_ROOT) if nvml is not None else (None, "nvidia-ml-py missing")
    if from_nvml is None:
        print("NVML:", why)
    else:
        show("NVML", from_nvml)
    from_smi, warnings = _read_nvidia_smi(smi, PCI_ROOT) if smi else (None, ["no nvidia-smi"])
    for w in warnings:
        print("nvidia-smi:", w)
    if from_smi is not None:
        show("nvidia-smi", from_smi)
    if not from_nvml or not from_smi or not smi:
        print("FAIL: a source found no GPU")
        return 1
    diffs = differences(from_nvml, from_smi)
    apps = subprocess.run([smi, *COMPUTE_APPS_ARGS], capture_output=True, text=True, check=False)
    if apps.returncode == 0:
        diffs += process_differences(from_nvml, parse_compute_apps(apps.stdout))
    else:
        print("nvidia-smi --query-compute-apps failed:", apps.stderr.strip()[:300])
    for d in diffs:
        print("DIFF:", d)
    print("discovery:", "the two sources agree" if not diffs else f"{len(diffs)} difference(s)")
    rc = 1 if diffs else 0
    if args.real_engine:
        if not os.environ.get("LLMGW_VLLM_VENV"):
            print("FAIL: set LLMGW_VLLM_VENV to a venv with vLLM's GPU build (pip install vllm)")
            return 1
        env = {**os.environ, "LLMGW_REQUIRE_REAL_ENGINE": "1"}
        rc |= subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "real_engine", "tests/real_engine"],
                             env=env, check=False).returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())

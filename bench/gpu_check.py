"""The GPU check (issues 18, 30): one command, at most 9 minutes, on a machine with NVIDIA GPUs.

On the GPU machine we are lent (PyTorch with CUDA, nvidia-ml-py; no vLLM, no network),
from this checkout with the wheels bench/gpu_wheels.py made here (dist/gpu-wheels):

    pip install --no-index --find-links dist/gpu-wheels llmgw && python bench/gpu_check.py

    python bench/gpu_check.py [--engine standin|simulated|vllm] [--out gpu_check.json]

Modes (`--engine`):

- standin (the default): real NVML and nvidia-smi, and the torch stand-in for vLLM
  (bench/gpu_check_vllm.py: vLLM's argv, CUDA_VISIBLE_DEVICES and memory rules, memory
  held with torch, served by llmgw's simulated engine) as `engines.vllm.bin`.
- simulated: the suite's (tests/integration/test_gpu_check_simulated.py): the agent's
  NVML faked from a state file (bench/gpu_check_fake_nvml), the stand-in in its fake-CUDA
  mode over that file. The steps that need real NVML, nvidia-smi or CUDA are not in it.
- vllm: real vLLM installed into a venv (`--vllm`, `--venv`; needs the package index),
  a tiny model made locally; the stand-in's stalling and sleeping steps are not in it.

Steps, in order (each one's pass/fail, seconds, figures and notes go into the JSON):

1. facts: `nvidia-smi -q` and `nvidia-smi topo -m`, saved (bounded); driver and CUDA
   versions, GPU count.
2. discovery: llmgw's two GPU sources (NVML, the nvidia-smi fallback) compared on every
   FIELDS value and process; a GPU NVML reports unhealthy fails it.
3. nvml_calls: every NVML call llmgw's readers make (inventory, memory, utilisation, the
   Xid watch), each with its arguments and what it returned or raised: a raw table.
4. cuda_numbering: CUDA's devices from child processes (CUDA_DEVICE_ORDER=PCI_BUS_ID;
   then CUDA_VISIBLE_DEVICES=n for each n) against NVML's indices, by UUID.
5. preflight: llmgw's pre-flight probe at world size 1 on GPU 0; it must run NCCL.
6. install_vllm, make_model (vllm mode only).
7. cluster: llmgw server, agent (NVML) and router as real processes.
8. serve: a replica ready on a GPU through llmgw's launch plans; the engine's
   CUDA_VISIBLE_DEVICES NVML indices; a chat completion through the router.
9. foreign_memory: a process (`train.py`) takes ~85% of every GPU; a deployment that
   would land there must not start, and ctl describe's reason must name its pid.
10. kill_while_loading: an engine's session leader SIGKILLed while it loads; seconds
    until its GPU memory is back (NVML) and until a replica is placed there again.
11. startup_deadline: a silent stand-in and one logging vLLM's shm_broadcast wait line,
    startup_timeout 8 s: both failed near 8 s, not held until startup_max.
12. sleep_wake: sleep_when_idle; NVML's used memory awake, asleep, woken by a request.

A global deadline (`--deadline`, 540 s) bounds every wait (SIGALRM past it); 30 s of it
are kept for the cleanup (every process the check started is stopped by pid). A step
that raises fails alone; a step past the deadline, or whose needs did not pass, is "not
run", which fails the check: exit 0 only when every step passed.

The JSON (`--out`): {"check", "mode", "deadline_s", "seconds", "passed",
"steps": [{"name", "status": "pass"|"fail"|"not run", "seconds", "figures", "notes"}],
"steps_not_in_mode", "cannot_check"}. It is written again after every step, so a run cut
short leaves what it found.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from gpu_check_steps import (
    NOT_RUN,
    Deadline,
    DeadlinePassed,
    Outcome,
    Step,
    StepResult,
    facts,
    install_vllm,
    make_model,
    report,
    run_steps,
    which_uv,
)

from llmgw.agent.discovery.gpus import PCI_ROOT, _read_nvidia_smi, _try_nvml, load_nvml
from llmgw.model.inventory import Gpu

VLLM_DEFAULT = "vllm==0.32.0"  # the version the CPU tier runs (tests/real_engine/install_vllm.sh)
DEADLINE = 540.0
CLEANUP_RESERVE = 30.0
ALL_STEPS = ("facts", "discovery", "nvml_calls", "cuda_numbering", "preflight", "install_vllm",
             "make_model", "cluster", "serve", "foreign_memory", "kill_while_loading",
             "startup_deadline", "sleep_wake")
# What no mode of this check reaches, in the JSON so that a pass is not read as more.
CANNOT_CHECK = (
    "tensor parallel > 1 (one GPU lent): NCCL and vLLM's custom all-reduce across GPUs, "
    "the pre-flight at world size > 1",
    "NVLink peers and NVSwitch fabric state (one GPU: nvlink_peers is empty)",
    "NCCL over InfiniBand/RoCE and multi-node gangs (one node, no HCA)",
    "Xid events (none is raised on purpose)",
)
NOT_IN_STANDIN = ("real vLLM: its load, CUDA graphs, KV cache sizing, its own sleep (cumem) "
                  "and its shutdown; the stand-in applies vLLM's rules and holds memory with torch",)
NOT_IN_SIMULATED = ("NVML, nvidia-smi, CUDA, the driver's release of memory: all faked",)

# The Gpu fields both discovery paths read; a difference in any is a finding. Not
# memory_free (it moves between the two reads). nvidia-smi's query reads no health and no
# processes: NVML's problems are shown, and its process list is checked against
# `nvidia-smi --query-compute-apps` (process_differences).
FIELDS = ("index", "uuid", "name", "memory_total", "pci_bus_id", "numa_node", "compute_capability",
          "nvlink_peers", "pci_path")
COMPUTE_APPS_ARGS = ("--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits")
# Two reads a moment apart: a process's memory may move this much between them.
PROCESS_MEMORY_SLACK_MIB = 256


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
    """Every FIELDS difference between NVML's GPUs (`a`) and nvidia-smi's (`b`), by UUID."""
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


def gpu_json(g: Gpu) -> dict[str, Any]:
    return {"index": g.index, "uuid": g.uuid, "name": g.name, "memory_total": g.memory_total,
            "memory_free": g.memory_free, "pci_bus_id": g.pci_bus_id, "numa_node": g.numa_node,
            "compute_capability": g.compute_capability, "nvlink_peers": dict(g.nvlink_peers),
            "pci_path": list(g.pci_path), "problems": list(g.problems),
            "processes": [{"pid": p.pid, "command": p.command, "memory": p.memory} for p in g.processes]}


def discovery(nvml: Any | None, smi: str | None, pci_root: str = PCI_ROOT) -> Outcome:
    """llmgw's two GPU sources, compared field by field. Passes when both found GPUs,
    they agree on every FIELDS value, and NVML reports no GPU unhealthy."""
    notes: list[str] = []
    if nvml is None:
        from_nvml, why = None, "nvidia-ml-py (pynvml) not importable"
    else:
        from_nvml, why = _try_nvml(nvml, pci_root)
    if from_nvml is None:
        notes.append(f"NVML: {why}")
    elif not from_nvml:
        notes.append("NVML counted no GPU")
    from_smi, warnings = _read_nvidia_smi(smi, pci_root) if smi else (None, ["not found on PATH"])
    notes.extend(f"nvidia-smi: {w}" for w in warnings)
    if from_smi is not None and not from_smi:
        notes.append("nvidia-smi listed no GPU")
    fig: dict[str, Any] = {"fields": list(FIELDS), "nvml": [gpu_json(g) for g in from_nvml or []],
                           "nvidia_smi": [gpu_json(g) for g in from_smi or []]}
    ok = bool(from_nvml) and bool(from_smi)
    if from_nvml and from_smi and smi:
        diffs = differences(from_nvml, from_smi)
        apps = subprocess.run([smi, *COMPUTE_APPS_ARGS], capture_output=True, text=True,
                              check=False, timeout=60)
        if apps.returncode == 0:
            diffs += process_differences(from_nvml, parse_compute_apps(apps.stdout))
        else:
            notes.append(f"nvidia-smi --query-compute-apps failed: {apps.stderr.strip()[:300]}")
        fig["differences"] = diffs
        notes.extend(f"differs: {d}" for d in diffs)
        ok = ok and not diffs
    unhealthy = {g.uuid: list(g.problems) for g in from_nvml or [] if g.problems}
    fig["unhealthy"] = unhealthy
    if unhealthy:
        notes.append(f"NVML reports {len(unhealthy)} GPU(s) unhealthy: {unhealthy}")
        ok = False
    return Outcome(ok, fig, tuple(notes))


def plan(args: argparse.Namespace, work: Path, ctx: dict[str, Any]) -> list[Step]:
    """The steps of `args.engine`'s mode, each a closure over its inputs."""
    import gpu_check_live as live  # after sys.path holds tests/ (it imports tests/fakes)
    import gpu_check_probes as probes

    from fakes.engines import free_port

    deadline: Deadline = ctx["deadline"]
    steps: list[Step] = []
    needs: tuple[str, ...] = ()
    side: Callable[[], Any]
    if args.engine in ("standin", "vllm"):
        smi = shutil.which("nvidia-smi")
        nvml = load_nvml()

        def uuids() -> dict[int, str]:
            return {g.index: u for u, g in live.read_gpus(nvml).items()}

        steps += [
            ("facts", lambda: facts(smi), ()),
            ("discovery", lambda: discovery(nvml, smi), ()),
            ("nvml_calls", lambda: probes.nvml_calls(nvml, PCI_ROOT), ()),
        ]
        if args.engine == "standin":
            steps += [
                ("cuda_numbering", lambda: probes.cuda_numbering(uuids(), deadline), ()),
                ("preflight", lambda: probes.preflight_probe(free_port(), deadline), ()),
            ]

            def side() -> Any:
                return live.StandinSide(work, nvml)
        else:
            venv = Path(args.venv) if args.venv else Path(tempfile.gettempdir()) / (
                "llmgw-gpu-check-" + args.vllm.replace("=", "").replace("/", "_"))
            model = work / "tiny-gpu"

            def side() -> Any:
                return live.VllmSide(venv, model, nvml)

            steps += [
                ("install_vllm", lambda: install_vllm(args.vllm, venv, deadline, uv=which_uv()), ()),
                ("make_model", lambda: make_model(venv / "bin" / "python", model, deadline), ("install_vllm",)),
            ]
            needs = ("install_vllm", "make_model")
    else:
        def side() -> Any:
            return live.SimulatedSide(work)

        steps.append(("nvml_calls", lambda: probes.nvml_calls(live.load_fake_nvml().current(), PCI_ROOT), ()))

    def cluster() -> Outcome:
        ctx["rig"] = live.GpuRig(work / "cluster", side())
        return live.cluster_up(ctx["rig"], deadline)

    steps += [
        ("cluster", cluster, needs),
        ("serve", lambda: live.serve(ctx["rig"], deadline), ("cluster",)),
        ("foreign_memory", lambda: live.foreign_memory(ctx["rig"], deadline), ("cluster",)),
        ("kill_while_loading", lambda: live.kill_while_loading(ctx["rig"], deadline), ("cluster",)),
    ]
    if args.engine != "vllm":
        steps += [
            ("startup_deadline", lambda: live.startup_deadline(ctx["rig"], deadline), ("cluster",)),
            ("sleep_wake", lambda: live.sleep_wake(ctx["rig"], deadline), ("cluster",)),
        ]
    return steps


def cannot_check(mode: str) -> list[str]:
    extra = {"standin": NOT_IN_STANDIN, "simulated": NOT_IN_STANDIN + NOT_IN_SIMULATED}.get(mode, ())
    return [*CANNOT_CHECK, *extra]


def _alarm(_sig: int, _frame: FrameType | None) -> None:
    raise DeadlinePassed()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--engine", choices=("standin", "simulated", "vllm"), default="standin",
                    help="standin: on the GPUs with the torch stand-in for vLLM (default); "
                         "simulated: on CPU, faked NVML; vllm: real vLLM installed into a venv")
    ap.add_argument("--vllm", default=VLLM_DEFAULT, help=f"the pip requirement (default {VLLM_DEFAULT})")
    ap.add_argument("--venv", default="", help="vLLM's venv (default: a folder per version under the temp dir)")
    ap.add_argument("--out", default="gpu_check.json", help="the JSON figures (default gpu_check.json)")
    ap.add_argument("--work", default="", help="scratch folder (default: a new temp dir, removed after)")
    ap.add_argument("--deadline", type=float, default=DEADLINE, help="seconds for the whole check")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    t0 = time.monotonic()
    reserve = min(CLEANUP_RESERVE, args.deadline / 4)
    deadline = Deadline(args.deadline, reserve)
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="llmgw-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx: dict[str, Any] = {"deadline": deadline}
    out = Path(args.out)
    steps = plan(args, work, ctx)
    names = [s[0] for s in steps]
    not_in_mode = [n for n in ALL_STEPS if n not in names]

    def document(results: list[StepResult]) -> dict[str, Any]:
        doc = report(args.engine, results, time.monotonic() - t0, args.deadline, not_in_mode)
        return {**doc, "cannot_check": cannot_check(args.engine)}

    def write(results: list[StepResult]) -> None:
        done = {r.name for r in results}
        pending = [*results, *(StepResult(n, NOT_RUN, 0.0, notes=("not reached yet",))
                               for n in names if n not in done)]
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(document(pending), indent=2))
        os.replace(tmp, out)

    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(max(1, int(args.deadline - reserve / 2)))
    results: list[StepResult] = []
    try:
        results = run_steps(steps, deadline, on_result=write)
    finally:
        signal.alarm(0)
        rig = ctx.get("rig")
        if rig is not None:
            from gpu_check_live import stop_all
            stop_all(rig)
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    doc = document(results)
    out.write_text(json.dumps(doc, indent=2))
    for r in results:
        print(f"{r.status:8} {r.name:20} {r.seconds:7.1f}s  {'; '.join(r.notes)[:300]}")
    print(f"{'PASS' if doc['passed'] else 'FAIL'}: {out} ({doc['seconds']:.0f} s)")
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

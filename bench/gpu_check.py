"""The GPU check (issue 18): one command, at most 9 minutes, on a machine with NVIDIA GPUs.

Run it as root on the GPU machine, from a checkout with llmgw installed with its test
extra (`pip install -e '.[test]'`: the check drives the router with the `openai` client);
the machine needs the package index and nothing else from outside:

    python bench/gpu_check.py [--vllm vllm==0.32.0] [--venv DIR] [--out gpu_check.json]
    python bench/gpu_check.py --engine simulated       # steps 5-7 on CPU, faked NVML

Steps, in order (each one's pass/fail, seconds and figures go into the JSON):

1. facts: `nvidia-smi -q` and `nvidia-smi topo -m`, saved (bounded); driver and CUDA
   versions, GPU count.
2. discovery: llmgw's two GPU sources (NVML through nvidia-ml-py, the nvidia-smi
   fallback) compared on every FIELDS value; a GPU NVML reports unhealthy fails it.
3. install_vllm: `--vllm` into a venv of its own (`--venv`; uv when on PATH, else pip),
   timed; a venv that has that version already is reused. torch must see CUDA.
4. make_model: a tiny Llama made locally (tests/real_engine/make_model.py --shape gpu:
   head_dim 64, dimensions multiples of 64, float16); no download.
5. cluster: llmgw server, agent (NVML, the real vLLM as engines.vllm.bin) and router as
   real processes (tests/fakes/live.py Cluster; tests/real_engine's Rig).
6. serve: the model ready on a GPU through llmgw's launch plans; the engine's
   CUDA_VISIBLE_DEVICES must be NVML indices; a chat completion through the router.
7. foreign_memory: a torch process (`train.py`) takes ~85% of every GPU; a deployment
   that would land there must not start, and ctl describe's reason must name its pid.
8. kill_while_loading: an engine's session leader SIGKILLed while it loads; seconds
   until its GPU memory is back (NVML) and until a replica is placed on that GPU again
   (placed before the memory is back fails).

A global deadline (`--deadline`, 540 s) bounds every wait; 30 s of it are kept for the
cleanup (every process the check started is stopped by pid). A step past the deadline,
or whose needs did not pass, is "not run", which fails the check: exit 0 only when every
step passed.

`--engine simulated` runs steps 5-8 with llmgw's simulated engine and an agent whose
pynvml is bench/gpu_check_fake_nvml (GPUs from a state file, where the check lists its
sleeping `train.py` as holding 85% of each GPU); steps 1-4 are not in that mode. The
suite runs that mode and steps 1-4 against tests/fakes (tests/integration/
test_gpu_check_simulated.py, tests/unit/test_gpu_check.py): only a GPU run checks real
NVML, nvidia-smi, CUDA, vLLM's own memory use and the driver's release of it.

Not a step yet (issue 25, autoscale.sleep_when_idle; sleep mode needs CUDA, so the suite
checks it on the simulated engine only): a deployment with `sleep_when_idle: true` and a
short `idle_to_zero`, idle until `GET /is_sleeping` says true; then NVML's used memory of
its GPU (should fall to about the CUDA context: weights and KV cache freed), the seconds
from a request through the router to its first token (vLLM publishes 0.1-0.4 s for the
wake itself), and the engine's pid unchanged.

The JSON (`--out`): {"check", "mode", "deadline_s", "seconds", "passed",
"steps": [{"name", "status": "pass"|"fail"|"not run", "seconds", "figures", "notes"}],
"steps_not_in_mode"}. It is written again after every step, so a run cut short leaves
what it found.
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
ALL_STEPS = ("facts", "discovery", "install_vllm", "make_model", "cluster", "serve", "foreign_memory",
             "kill_while_loading")

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
    import gpu_check_live as live  # after sys.path holds tests/ (it imports the rig)

    deadline: Deadline = ctx["deadline"]
    steps: list[Step] = []
    if args.engine == "vllm":
        smi = shutil.which("nvidia-smi")
        nvml = load_nvml()
        venv = Path(args.venv) if args.venv else Path(tempfile.gettempdir()) / (
            "llmgw-gpu-check-" + args.vllm.replace("=", "").replace("/", "_"))
        model = work / "tiny-gpu"

        def side() -> Any:
            return live.VllmSide(venv, model, nvml)

        steps += [
            ("facts", lambda: facts(smi), ()),
            ("discovery", lambda: discovery(nvml, smi), ()),
            ("install_vllm", lambda: install_vllm(args.vllm, venv, deadline, uv=which_uv()), ()),
            ("make_model", lambda: make_model(venv / "bin" / "python", model, deadline), ("install_vllm",)),
        ]
        needs: tuple[str, ...] = ("install_vllm", "make_model")
    else:
        def side() -> Any:
            return live.SimulatedSide(work)

        needs = ()

    def cluster() -> Outcome:
        ctx["rig"] = live.GpuRig(work / "cluster", side())
        return live.cluster_up(ctx["rig"], deadline)

    steps += [
        ("cluster", cluster, needs),
        ("serve", lambda: live.serve(ctx["rig"], deadline), ("cluster",)),
        ("foreign_memory", lambda: live.foreign_memory(ctx["rig"], deadline), ("cluster",)),
        ("kill_while_loading", lambda: live.kill_while_loading(ctx["rig"], deadline), ("cluster",)),
    ]
    return steps


def _alarm(_sig: int, _frame: FrameType | None) -> None:
    raise DeadlinePassed()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--engine", choices=("vllm", "simulated"), default="vllm",
                    help="vllm: the whole check on the GPUs; simulated: steps 5-8 on CPU, faked NVML")
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

    def write(results: list[StepResult]) -> None:
        done = {r.name for r in results}
        pending = [*results, *(StepResult(n, NOT_RUN, 0.0, notes=("not reached yet",))
                               for n in names if n not in done)]
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(report(args.engine, pending, time.monotonic() - t0, args.deadline,
                                         not_in_mode), indent=2))
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
    doc = report(args.engine, results, time.monotonic() - t0, args.deadline, not_in_mode)
    out.write_text(json.dumps(doc, indent=2))
    for r in results:
        print(f"{r.status:8} {r.name:20} {r.seconds:7.1f}s  {'; '.join(r.notes)[:300]}")
    print(f"{'PASS' if doc['passed'] else 'FAIL'}: {out} ({doc['seconds']:.0f} s)")
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

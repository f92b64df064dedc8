"""The GPU check's frame (deadline, step runner, report) and its steps 1, 3 and 4
(bench/gpu_check.py runs them; step 2, discovery, lives there beside FIELDS).

Each step is a function of its inputs (an nvml object, an nvidia-smi path, a venv, a
deadline) that returns an Outcome: passed or not, figures, notes. None of them needs a
GPU to run: the suite runs them against tests/fakes (FakeNvml, fake nvidia-smi writers);
on a GPU machine they get the real pynvml and nvidia-smi.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from attrs import define, field, frozen

REPO = Path(__file__).resolve().parent.parent
MAKE_MODEL = REPO / "tests" / "real_engine" / "make_model.py"
# What the JSON keeps of each tool's text: `nvidia-smi -q` on 8 GPUs is about 60 KiB.
FACT_MAX_CHARS = 128 * 1024
TOOL_TIMEOUT = 30.0

PASS, FAIL, NOT_RUN = "pass", "fail", "not run"

class DeadlinePassed(BaseException):
    """The global deadline went by (SIGALRM): no step may swallow it."""


@frozen
class Outcome:
    passed: bool
    figures: dict[str, Any] = field(factory=dict)
    notes: tuple[str, ...] = ()


@frozen
class StepResult:
    name: str
    status: str  # PASS, FAIL or NOT_RUN
    seconds: float
    figures: dict[str, Any] = field(factory=dict)
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "seconds": round(self.seconds, 2),
                "figures": self.figures, "notes": list(self.notes)}


@define
class Deadline:
    """Seconds left for the steps: `total` from `start`, less `reserve` kept for the
    cleanup after the last step (stopping engines, writing the JSON)."""

    total: float
    reserve: float = 0.0
    clock: Callable[[], float] = time.monotonic
    start: float = field(default=-1.0)

    def __attrs_post_init__(self) -> None:
        if self.start < 0:
            self.start = self.clock()

    def left(self) -> float:
        return max(0.0, self.start + self.total - self.reserve - self.clock())

    def bound(self, seconds: float) -> float:
        """`seconds`, or less where the deadline comes first."""
        return min(seconds, self.left())


Step = tuple[str, Callable[[], Outcome], tuple[str, ...]]  # name, run, names it needs


def run_steps(steps: Sequence[Step], deadline: Deadline,
              on_result: Callable[[list[StepResult]], None] = lambda _r: None,
              clock: Callable[[], float] = time.monotonic) -> list[StepResult]:
    """Run `steps` in order. A step whose needs did not pass, or that comes after the
    deadline, is NOT_RUN (never a pass). A step that raises fails with the error. Past
    DeadlinePassed (raised into a running step) every later step is NOT_RUN."""
    results: list[StepResult] = []
    passed: set[str] = set()
    expired = False
    for name, run, needs in steps:
        missing = [n for n in needs if n not in passed]
        if expired or deadline.left() <= 0:
            results.append(StepResult(name, NOT_RUN, 0.0, notes=("past the global deadline",)))
        elif missing:
            results.append(StepResult(name, NOT_RUN, 0.0,
                                      notes=(f"needs {', '.join(missing)}, which did not pass",)))
        else:
            t0 = clock()
            try:
                out = run()
            except DeadlinePassed:
                expired = True
                out = Outcome(False, notes=("the global deadline passed while it ran",))
            except Exception as exc:  # one step's bug or failure costs that step only
                out = Outcome(False, notes=(f"{type(exc).__name__}: {exc}",))
            results.append(StepResult(name, PASS if out.passed else FAIL, clock() - t0,
                                      out.figures, out.notes))
            if out.passed:
                passed.add(name)
        on_result(results)
    return results


def report(mode: str, results: Sequence[StepResult], seconds: float, deadline_s: float,
           not_in_mode: Sequence[str] = ()) -> dict[str, Any]:
    """The JSON document: passed only when every step of the mode passed."""
    return {"check": "llmgw bench/gpu_check.py", "mode": mode, "deadline_s": deadline_s,
            "seconds": round(seconds, 2),
            "passed": bool(results) and all(r.status == PASS for r in results),
            "steps": [r.to_json() for r in results], "steps_not_in_mode": list(not_in_mode)}


# -- step 1: facts ---------------------------------------------------------------------


def bounded(text: str, limit: int = FACT_MAX_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters]"


def _tool(argv: list[str], timeout: float) -> tuple[int, str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                           errors="replace")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, f"{argv[0]} could not be run: {exc}"
    return p.returncode, p.stdout + (("\n[stderr]\n" + p.stderr) if p.stderr.strip() else "")


_Q_FIELD = re.compile(r"^\s*(Driver Version|CUDA Version|Attached GPUs)\s*:\s*(\S.*?)\s*$", re.M)


def query_facts(text: str) -> dict[str, str]:
    """Driver version, CUDA version and GPU count from `nvidia-smi -q` text ({} when absent)."""
    return {m.group(1): m.group(2) for m in _Q_FIELD.finditer(text)}


def facts(smi: str | None, timeout: float = TOOL_TIMEOUT) -> Outcome:
    """`nvidia-smi -q` and `nvidia-smi topo -m`, saved (bounded). Passes when both ran
    and `-q` names at least one attached GPU."""
    if not smi:
        return Outcome(False, notes=("nvidia-smi not found on PATH",))
    q_rc, q = _tool([smi, "-q"], timeout)
    t_rc, t = _tool([smi, "topo", "-m"], timeout)
    found = query_facts(q)
    figures: dict[str, Any] = {
        "nvidia_smi": smi, "driver_version": found.get("Driver Version", ""),
        "cuda_version": found.get("CUDA Version", ""), "attached_gpus": found.get("Attached GPUs", ""),
        "query_rc": q_rc, "topo_rc": t_rc, "query": bounded(q), "topo": bounded(t)}
    notes = []
    if q_rc != 0:
        notes.append(f"nvidia-smi -q exited {q_rc}")
    if t_rc != 0:
        notes.append(f"nvidia-smi topo -m exited {t_rc}")
    count = found.get("Attached GPUs", "")
    if not count.isdigit() or int(count) < 1:
        notes.append(f"nvidia-smi -q names no attached GPU ({count or 'no such line'})")
    return Outcome(not notes, figures, tuple(notes))


# -- step 3: vLLM in a venv of its own -------------------------------------------------


# What the venv's python prints: the versions, and whether torch sees the GPUs.
PROBE = ("import json, torch, vllm; print(json.dumps({'vllm': vllm.__version__, "
         "'torch': torch.__version__, 'torch_cuda': torch.version.cuda, "
         "'cuda_available': torch.cuda.is_available(), 'devices': torch.cuda.device_count()}))")


def install_commands(spec: str, venv: Path, python: str = sys.executable,
                     uv: str | None = None) -> list[list[str]]:
    """The commands that make `venv` and install `spec` into it: uv where it is on PATH
    (several times faster on vLLM's 3+ GB of wheels), else venv + pip."""
    vpy = str(venv / "bin" / "python")
    if uv:
        return [[uv, "venv", "--python", python, str(venv)],
                [uv, "pip", "install", "--python", vpy, spec]]
    return [[python, "-m", "venv", str(venv)],
            [vpy, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", spec]]


def probe_venv(venv: Path, timeout: float) -> tuple[dict[str, Any] | None, str]:
    py = venv / "bin" / "python"
    if not py.exists():
        return None, f"{py} does not exist"
    try:
        p = subprocess.run([str(py), "-c", PROBE], capture_output=True, text=True, timeout=timeout,
                           check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"probe: {exc}"
    if p.returncode != 0:
        return None, f"probe exited {p.returncode}: {(p.stderr or p.stdout).strip()[-800:]}"
    try:
        found = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        return None, f"probe printed no JSON ({exc}): {p.stdout[-300:]!r}"
    return (found, "") if isinstance(found, dict) else (None, f"probe printed {found!r}")


def install_vllm(spec: str, venv: Path, deadline: Deadline, *, python: str = sys.executable,
                 uv: str | None = None, need_cuda: bool = True) -> Outcome:
    """`spec` (e.g. "vllm==0.32.0") in `venv`, timed; a venv that already has that version
    is reused (and says so). Passes when vLLM imports and, with `need_cuda`, torch sees a
    CUDA device."""
    want = spec.partition("==")[2]
    figures: dict[str, Any] = {"spec": spec, "venv": str(venv), "installer": "uv" if uv else "pip"}
    found, why = probe_venv(venv, deadline.bound(120)) if venv.exists() else (None, "")
    if found is not None and (not want or found.get("vllm") == want):
        figures["reused"] = True
    else:
        figures["reused"] = False
        if venv.exists():
            shutil.rmtree(venv)
        t0 = time.monotonic()
        for argv in install_commands(spec, venv, python, uv):
            left = deadline.left()
            if left <= 0:
                return Outcome(False, figures, ("past the deadline while installing",))
            try:
                p = subprocess.run(argv, capture_output=True, text=True, timeout=left, check=False)
            except subprocess.TimeoutExpired:
                return Outcome(False, figures, (f"{argv[0]} {argv[1]} ran past the deadline",))
            if p.returncode != 0:
                return Outcome(False, figures, (f"{' '.join(argv[:3])} exited {p.returncode}: "
                                                f"{(p.stderr or p.stdout).strip()[-1500:]}",))
        figures["install_s"] = round(time.monotonic() - t0, 1)
        found, why = probe_venv(venv, deadline.bound(120))
    if found is None:
        return Outcome(False, figures, (why,))
    figures.update(found)
    notes = []
    if want and found.get("vllm") != want:
        notes.append(f"vLLM {found.get('vllm')} installed, {want} asked for")
    if need_cuda and not found.get("cuda_available"):
        notes.append(f"torch {found.get('torch')} (CUDA {found.get('torch_cuda')}) sees no CUDA "
                     "device: a CPU build of torch, or a driver older than its CUDA")
    return Outcome(not notes, figures, tuple(notes))


# -- step 4: the tiny model ------------------------------------------------------------


def make_model(python: Path, out: Path, deadline: Deadline, shape: str = "gpu") -> Outcome:
    """tests/real_engine/make_model.py with `python` (the vLLM venv's: torch and
    transformers are there), no download."""
    try:
        p = subprocess.run([str(python), str(MAKE_MODEL), str(out), "--shape", shape],
                           capture_output=True, text=True, timeout=deadline.bound(300), check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Outcome(False, notes=(f"make_model: {exc}",))
    figures: dict[str, Any] = {"path": str(out), "shape": shape, "said": p.stdout.strip()[-300:]}
    if p.returncode != 0:
        return Outcome(False, figures, (f"make_model exited {p.returncode}: {p.stderr.strip()[-1500:]}",))
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (out / f).exists()]
    if missing:
        return Outcome(False, figures, (f"make_model wrote no {', '.join(missing)}",))
    figures["bytes"] = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    return Outcome(True, figures)


def which_uv() -> str | None:
    return shutil.which("uv") if os.environ.get("LLMGW_GPU_CHECK_PIP") != "1" else None

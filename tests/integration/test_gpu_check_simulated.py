"""bench/gpu_check.py --engine simulated: the GPU check's steps 5-8 as one command on CPU.

Real llmgw server, agent and router; the simulated engine through llmgw's launch plans;
the agent's pynvml faked from a state file (bench/gpu_check_fake_nvml), where the check
lists its own sleeping `train.py` as holding 85% of the GPU. What this cannot check, and
only a GPU run does: NVML's own process list and memory figures, CUDA, vLLM's memory use
and the driver giving memory back after a SIGKILL.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_simulated_check_passes_every_step_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--engine", "simulated",
                        "--out", str(out), "--work", str(tmp_path / "work"), "--deadline", "120"],
                       capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert out.exists(), p.stdout + p.stderr
    doc = json.loads(out.read_text())
    steps = {s["name"]: s for s in doc["steps"]}
    assert list(steps) == ["cluster", "serve", "foreign_memory", "kill_while_loading"]
    failed = {n: s["notes"] for n, s in steps.items() if s["status"] != "pass"}
    assert not failed and p.returncode == 0 and doc["passed"], (failed, p.stdout[-2000:], p.stderr[-2000:])

    assert steps["cluster"]["figures"]["gpu_source"] == "nvml"  # the faked pynvml, not simulated GPUs
    serve = steps["serve"]["figures"]
    assert serve["cuda_visible_devices"] == "0" and serve["completion_tokens"] == 5

    foreign = steps["foreign_memory"]["figures"]
    # Refused by placement (pending) or, placed before the inventory showed the hog, by the
    # agent's own check before the spawn (backoff): either way the reason names the pid.
    assert f"pid {foreign['pid']}" in foreign["reason"] and foreign["state"] in ("pending", "backoff")
    assert foreign["nvml_lists_it"] is True

    kill = steps["kill_while_loading"]["figures"]
    assert kill["state_at_kill"] == "starting"  # killed while it loaded
    assert kill["memory_back_s"] is not None and kill["placed_again_s"] is not None
    assert kill["placed_again_s"] >= kill["memory_back_s"]

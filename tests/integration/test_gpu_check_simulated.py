"""bench/gpu_check.py --engine simulated: the GPU check's steps that can run without a GPU,
as one command on CPU.

Real llmgw server, agent and router; the torch stand-in for vLLM (bench/gpu_check_vllm.py)
as `engines.vllm.bin`, in its fake-CUDA mode; the agent's pynvml faked from a state file
(bench/gpu_check_fake_nvml), where the check lists its own sleeping `train.py` as holding
85% of the GPU and the stand-in lists the memory it holds. What this cannot check, and
only a GPU run does (the JSON's cannot_check says so): NVML's own process list and memory
figures, CUDA's numbering, NCCL, the driver giving memory back after a SIGKILL.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.live_long]  # a whole GPU check end to end (about a minute): .ci/run -m live_long


def test_simulated_check_passes_every_step_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--engine", "simulated",
                        "--out", str(out), "--work", str(tmp_path / "work"), "--deadline", "200"],
                       capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.exists(), p.stdout + p.stderr
    doc = json.loads(out.read_text())
    steps = {s["name"]: s for s in doc["steps"]}
    assert list(steps) == ["nvml_calls", "cluster", "serve", "foreign_memory", "kill_while_loading",
                           "startup_deadline", "sleep_wake"]
    failed = {n: s["notes"] for n, s in steps.items() if s["status"] != "pass"}
    assert not failed and p.returncode == 0 and doc["passed"], (failed, p.stdout[-2000:], p.stderr[-2000:])
    assert any("NVML, nvidia-smi, CUDA" in c for c in doc["cannot_check"])

    assert "nvmlDeviceGetMemoryInfo" in steps["nvml_calls"]["figures"]["distinct_calls"]
    assert steps["cluster"]["figures"]["gpu_source"] == "nvml"  # the faked pynvml, not simulated GPUs
    serve = steps["serve"]["figures"]
    assert serve["cuda_visible_devices"] == "0" and serve["completion_tokens"] == 5
    assert serve["engine_mib"] == 24576  # the stand-in's budget: 0.3 of the fake's 80 GiB

    foreign = steps["foreign_memory"]["figures"]
    # Refused by placement (pending) or, placed before the inventory showed the hog, by the
    # agent's own check before the spawn (backoff): either way the reason names the pid.
    assert f"pid {foreign['pid']}" in foreign["reason"] and foreign["state"] in ("pending", "backoff")
    assert foreign["nvml_lists_it"] is True

    kill = steps["kill_while_loading"]["figures"]
    assert kill["state_at_kill"] == "starting" and kill["held_mib_at_kill"] > 0  # killed while it loaded
    assert kill["memory_back_s"] is not None and kill["placed_again_s"] is not None
    assert kill["placed_again_s"] >= kill["memory_back_s"]

    stalls = steps["startup_deadline"]["figures"]
    for mode in ("silent", "broadcast"):  # failed at startup_timeout (8 s), not held for startup_max
        assert stalls[mode]["ended_after_s"] < 8 + 20 and "not ready within" in stalls[mode]["reason"]

    sleep = steps["sleep_wake"]["figures"]
    assert sleep["used_mib_asleep"] < sleep["used_mib_awake"] <= sleep["used_mib_woken"]
    assert sleep["wake_status"] == 200 and sleep["same_pid"] is True

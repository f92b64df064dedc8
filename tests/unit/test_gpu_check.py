"""bench/gpu_check.py's steps that need no GPU, against tests/fakes: the frame (deadline,
not-run, report), nvidia-smi facts, both discovery paths compared, the vLLM venv step,
make_model's GPU shape, the faked pynvml the simulated mode gives the agent, and the
check's own NVML read. The orchestration steps run in
tests/integration/test_gpu_check_simulated.py."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fakes.nvidia_smi import BUSES, FakeNvml, failing, one_bad_line, topo_matrix, write_script

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import gpu_check  # noqa: E402
import gpu_check_live as live  # noqa: E402
from gpu_check_steps import (  # noqa: E402
    FAIL,
    NOT_RUN,
    PASS,
    Deadline,
    DeadlinePassed,
    Outcome,
    bounded,
    facts,
    install_commands,
    install_vllm,
    query_facts,
    report,
    run_steps,
)

from llmgw.model.inventory import Gpu  # noqa: E402

NAME = "NVIDIA A100-SXM4-80GB"  # what FakeNvml answers
Q_TEXT = """
==============NVSMI LOG==============

Timestamp                                 : Thu Dec  4 14:00:00 2026
Driver Version                            : 570.133.20
CUDA Version                              : 12.8

Attached GPUs                             : 4
GPU 00000000:07:00.0
    Product Name                          : NVIDIA A100-SXM4-80GB
"""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def board(folder: Path, *, total: int = 81920, query_rc: int = 0) -> str:
    """A fake nvidia-smi that agrees with `nvml()`: 4 A100s, NVLink x4 between 0 and 1,
    NUMA 0,0,1,1; it answers `-q` with Q_TEXT."""
    q = "".join(f"{i}, GPU-{i:04d}, {NAME}, {total}, 80896, {b}, 8.0\n" for i, b in enumerate(BUSES))
    cells = [["X" if i == j else ("NV4" if {i, j} == {0, 1} else "SYS") for j in range(4)] for i in range(4)]
    inner = write_script(folder / "inner", q, topo_matrix(cells, ["0", "0", "1", "1"]), query_rc=query_rc)
    return str(with_q(folder, inner, Q_TEXT))


def with_q(folder: Path, inner: Path, text: str) -> Path:
    """`inner` (a tests/fakes nvidia-smi) that also answers `-q` with `text`."""
    path = folder / "nvidia-smi"
    path.write_text(f"#!{sys.executable}\nimport os, sys\n"
                    f"if sys.argv[1:] == ['-q']:\n    sys.stdout.write({text!r})\n    sys.exit(0)\n"
                    f"os.execv({str(inner)!r}, [{str(inner)!r}, *sys.argv[1:]])\n")
    os.chmod(path, 0o755)
    return path


def nvml(**kw: Any) -> FakeNvml:
    return FakeNvml(BUSES, {0: [BUSES[1]] * 4, 1: [BUSES[0]] * 4}, [0, 0, 1, 1], **kw)


# -- the frame -------------------------------------------------------------------------


def test_steps_whose_needs_failed_or_past_the_deadline_are_not_run_never_passed() -> None:
    clock = Clock()
    d = Deadline(60, reserve=10, clock=clock)
    ran: list[str] = []

    def step(name: str, ok: bool, advance: float = 0.0) -> Any:
        def run() -> Outcome:
            ran.append(name)
            clock.now += advance
            return Outcome(ok, {"n": name})
        return run

    def boom() -> Outcome:
        raise RuntimeError("engine log says no")

    results = run_steps([
        ("a", step("a", True), ()),
        ("b", step("b", False), ()),
        ("c", step("c", True), ("b",)),  # b failed: not run
        ("d", boom, ("a",)),
        ("e", step("e", True, advance=55), ("a",)),  # runs, and uses up the deadline
        ("f", step("f", True), ()),
    ], d, clock=clock)
    assert [(r.name, r.status) for r in results] == [
        ("a", PASS), ("b", FAIL), ("c", NOT_RUN), ("d", FAIL), ("e", PASS), ("f", NOT_RUN)]
    assert ran == ["a", "b", "e"]
    assert "needs b" in results[2].notes[0] and "RuntimeError: engine log says no" in results[3].notes[0]
    assert results[4].seconds == 55 and "deadline" in results[5].notes[0]
    doc = report("vllm", results, 61.0, 60)
    assert doc["passed"] is False and [s["status"] for s in doc["steps"]][2] == NOT_RUN
    json.dumps(doc)


def test_a_deadline_raised_into_a_step_fails_it_and_stops_the_rest() -> None:
    def hangs() -> Outcome:
        raise DeadlinePassed()

    results = run_steps([("a", hangs, ()), ("b", lambda: Outcome(True), ())], Deadline(60))
    assert [r.status for r in results] == [FAIL, NOT_RUN]


def test_report_passes_only_when_every_step_passed() -> None:
    ok = run_steps([("a", lambda: Outcome(True), ())], Deadline(60))
    assert report("simulated", ok, 1, 60, ["facts"])["passed"] is True
    assert report("simulated", [], 1, 60)["passed"] is False  # nothing ran: no pass


def test_deadline_bounds_waits_and_keeps_the_cleanup_reserve() -> None:
    clock = Clock()
    d = Deadline(100, reserve=30, clock=clock)
    assert d.left() == 70 and d.bound(400) == 70 and d.bound(5) == 5
    clock.now += 80
    assert d.left() == 0 and d.bound(5) == 0


def test_main_with_no_time_left_writes_every_step_as_not_run(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    rc = gpu_check.main(["--engine", "simulated", "--deadline", "0", "--out", str(out),
                         "--work", str(tmp_path / "w")])
    doc = json.loads(out.read_text())
    assert rc == 1 and doc["passed"] is False and doc["mode"] == "simulated"
    assert [s["name"] for s in doc["steps"]] == ["nvml_calls", "cluster", "serve", "foreign_memory",
                                                 "kill_while_loading", "startup_deadline", "sleep_wake"]
    assert {s["status"] for s in doc["steps"]} == {NOT_RUN}
    assert doc["steps_not_in_mode"] == ["facts", "discovery", "cuda_numbering", "preflight",
                                        "install_vllm", "make_model"]
    assert any("tensor parallel > 1" in c for c in doc["cannot_check"])


# -- step 1: facts ---------------------------------------------------------------------


def test_facts_saves_query_and_topology_and_reads_the_versions(tmp_path: Path) -> None:
    out = facts(board(tmp_path))
    assert out.passed, out.notes
    f = out.figures
    assert (f["driver_version"], f["cuda_version"], f["attached_gpus"]) == ("570.133.20", "12.8", "4")
    assert "NVSMI LOG" in f["query"] and "NV4" in f["topo"] and "Legend" in f["topo"]


def test_facts_fails_without_a_gpu_or_a_tool(tmp_path: Path) -> None:
    assert not facts(None).passed
    broken = facts(str(failing(tmp_path / "f")))
    assert not broken.passed and any("exited 18" in n for n in broken.notes)
    assert "Driver/library version mismatch" in broken.figures["query"]
    silent = write_script(tmp_path / "s", "", "")  # answers -q with nothing
    assert any("no attached GPU" in n for n in facts(str(silent)).notes)


def test_facts_text_is_bounded() -> None:
    text = bounded("x" * 1000, 100)
    assert len(text) < 200 and text.endswith("[... 900 more characters]")


@given(st.text())
def test_query_facts_never_raises(text: str) -> None:
    found = query_facts(text)
    assert set(found) <= {"Driver Version", "CUDA Version", "Attached GPUs"}


# -- step 2: discovery -----------------------------------------------------------------


def test_discovery_agrees_when_both_paths_read_the_same_gpus(tmp_path: Path) -> None:
    out = gpu_check.discovery(nvml(), board(tmp_path), str(tmp_path / "no-pci"))
    assert out.passed, out.notes
    assert len(out.figures["nvml"]) == len(out.figures["nvidia_smi"]) == 4
    assert out.figures["differences"] == [] and out.figures["fields"] == list(gpu_check.FIELDS)
    assert out.figures["nvml"][0]["nvlink_peers"] == {"GPU-0001": 4}


def test_discovery_names_each_field_that_differs(tmp_path: Path) -> None:
    out = gpu_check.discovery(nvml(), board(tmp_path, total=40960), str(tmp_path / "no-pci"))
    assert not out.passed
    assert sum("memory_total: NVML 81920 vs nvidia-smi 40960" in d for d in out.figures["differences"]) == 4


def test_discovery_fails_when_a_path_finds_nothing(tmp_path: Path) -> None:
    smi = board(tmp_path)
    no_nvml = gpu_check.discovery(nvml(fail_init=True), smi, str(tmp_path))
    assert not no_nvml.passed and any(n.startswith("NVML: NVML did not load") for n in no_nvml.notes)
    assert len(no_nvml.figures["nvidia_smi"]) == 4  # the other path is still shown
    assert not gpu_check.discovery(None, None).passed
    broken = gpu_check.discovery(nvml(), str(failing(tmp_path / "f")), str(tmp_path))
    assert not broken.passed and any(n.startswith("nvidia-smi:") for n in broken.notes)


def test_discovery_with_a_lost_gpu_or_a_bad_line_fails_and_says_which(tmp_path: Path) -> None:
    lost = gpu_check.discovery(nvml(lost={2}), board(tmp_path), str(tmp_path))
    assert not lost.passed
    assert any("lost" in p for ps in lost.figures["unhealthy"].values() for p in ps)
    bad = gpu_check.discovery(nvml(), str(one_bad_line(tmp_path / "b")), str(tmp_path))
    assert not bad.passed and bad.notes


def test_discovery_reports_unhealthy_gpus(tmp_path: Path) -> None:
    out = gpu_check.discovery(nvml(ecc={1: 3}, mig={3}), board(tmp_path), str(tmp_path))
    assert not out.passed
    assert set(out.figures["unhealthy"]) == {"GPU-0001", "GPU-0003"}


def test_differences_by_uuid() -> None:
    a = Gpu(index=0, uuid="GPU-a", name="x", memory_total=1, memory_free=1, pci_bus_id="b")
    assert gpu_check.differences([a], [a]) == []
    b = Gpu(index=1, uuid="GPU-a", name="x", memory_total=1, memory_free=0, pci_bus_id="b")
    assert gpu_check.differences([a], [b]) == ["GPU-a index: NVML 0 vs nvidia-smi 1"]  # not memory_free
    c = Gpu(index=0, uuid="GPU-c", name="x", memory_total=1, memory_free=1, pci_bus_id="b")
    assert gpu_check.differences([a], [c])[0].startswith("UUIDs differ")


# -- step 3: the vLLM venv -------------------------------------------------------------


def fake_venv(root: Path, probe: dict[str, Any] | None, rc: int = 0) -> Path:
    """A venv whose python prints `probe` as the check's probe would (no torch here)."""
    (root / "bin").mkdir(parents=True)
    py = root / "bin" / "python"
    py.write_text(f"#!/bin/sh\necho '{json.dumps(probe)}'\nexit {rc}\n")
    os.chmod(py, 0o755)
    return root


GOOD = {"vllm": "0.32.0", "torch": "2.13.0", "torch_cuda": "13.0", "cuda_available": True, "devices": 1}


def test_install_reuses_a_venv_with_that_version_and_needs_cuda(tmp_path: Path) -> None:
    out = install_vllm("vllm==0.32.0", fake_venv(tmp_path / "v", GOOD), Deadline(60))
    assert out.passed and out.figures["reused"] is True and out.figures["torch_cuda"] == "13.0"
    cpu = fake_venv(tmp_path / "c", {**GOOD, "cuda_available": False, "torch_cuda": None})
    out = install_vllm("vllm==0.32.0", cpu, Deadline(60))
    assert not out.passed and "sees no CUDA device" in out.notes[0]
    assert install_vllm("vllm==0.32.0", cpu, Deadline(60), need_cuda=False).passed


def test_install_stops_at_the_deadline(tmp_path: Path) -> None:
    clock = Clock()
    d = Deadline(10, clock=clock)
    clock.now += 11
    out = install_vllm("vllm==0.32.0", tmp_path / "absent", d)
    assert not out.passed and "deadline" in out.notes[0] and out.figures["reused"] is False


def test_install_commands_use_uv_where_it_is() -> None:
    v = Path("/tmp/v")
    assert install_commands("vllm==1", v, "/usr/bin/python3", "/bin/uv") == [
        ["/bin/uv", "venv", "--python", "/usr/bin/python3", "/tmp/v"],
        ["/bin/uv", "pip", "install", "--python", "/tmp/v/bin/python", "vllm==1"]]
    pip = install_commands("vllm==1", v, "/usr/bin/python3")
    assert pip[0] == ["/usr/bin/python3", "-m", "venv", "/tmp/v"] and pip[1][-1] == "vllm==1"


# -- step 4: the model's shape ---------------------------------------------------------


def make_model_module() -> Any:
    path = BENCH.parent / "tests" / "real_engine" / "make_model.py"
    spec = importlib.util.spec_from_file_location("make_model_for_test", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_shape_suits_cuda_kernels_and_cpu_shape_is_unchanged() -> None:
    mm = make_model_module()
    gpu = mm.shape_config("gpu")
    assert gpu["head_dim"] in (64, 128) and gpu["torch_dtype"] == "float16"
    assert gpu["hidden_size"] == gpu["head_dim"] * gpu["num_attention_heads"]
    assert all(gpu[k] % 64 == 0 for k in ("hidden_size", "intermediate_size", "vocab_size"))
    cpu = mm.shape_config("cpu")
    assert (cpu["hidden_size"], cpu["head_dim"], cpu["torch_dtype"]) == (128, 32, "float32")
    with pytest.raises(SystemExit):
        mm.shape_config("tpu")


# -- the faked pynvml and the check's own NVML read -------------------------------------


def test_fake_pynvml_follows_its_state_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state.json"
    monkeypatch.setenv("LLMGW_FAKE_NVML", str(state))
    fake = live.load_fake_nvml()
    idle = live.read_gpus(fake.current())  # no file yet: one idle GPU
    assert [(g.index, g.total, g.free, g.pids) for g in idle.values()] == [(0, 81920, 80896, {})]
    state.write_text(json.dumps({"gpus": 2, "total_mib": 4096, "processes": {"1": [[4242, 600]]}}))
    held = live.read_gpus(fake.current())
    # Free: the total less the driver's 1 GiB less what the processes hold.
    assert [(g.free, g.pids) for g in held.values()] == [(3072, {}), (2472, {4242: 600})]
    state.write_text("{not json")
    os.utime(state, ns=(1, 1))
    assert len(live.read_gpus(fake.current())) == 1  # garbage: one idle GPU, no error


def test_the_checks_nvml_read_sees_foreign_processes() -> None:
    seen = live.read_gpus(nvml(processes={2: [(4242, 61 * 2**30), (4242, 2**30)], 0: [(7, None)]}))
    assert seen["GPU-0002"].pids == {4242: 62 * 1024} and seen["GPU-0000"].pids == {7: 0}
    assert [g.index for g in seen.values()] == [0, 1, 2, 3]


def test_deployment_yaml_carries_the_sides_args_and_env() -> None:
    d = live.Deploy("vllm", "/m/tiny", ("--gpu-memory-utilization", "0.3"), {"A": "1"})
    text = d.yaml("held", "held", 120, {"B": "2"})
    assert '"--gpu-memory-utilization", "0.3"' in text and '"A": "1", "B": "2"' in text
    assert "startup_timeout: 120s" in text and "engine: vllm" in text

"""bench/gpu_check_vllm.py, the torch stand-in for vLLM: its argv, CUDA_VISIBLE_DEVICES,
UUID and free-memory rules (vLLM 0.32's words), and its fake-CUDA mode over the fake
NVML's state file, run as the process the agent would spawn."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fakes.engines import free_port

BENCH = Path(__file__).resolve().parents[2] / "bench"
STANDIN = BENCH / "gpu_check_vllm.py"


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sv = _load("gpu_check_vllm", STANDIN)
UUID0 = "GPU-fake0000-0000-0000-0000-000000000000"
UUID1 = "GPU-fake0001-0000-0000-0000-000000000001"
GIB = 1 << 30


# -- pure rules -------------------------------------------------------------------------


def test_argv_as_llmgw_passes_it_with_unknown_flags_kept_aside() -> None:
    ns, unknown = sv.parse_serve(["serve", "/m/tiny", "--host", "10.0.0.1", "--port", "8123",
                                  "--served-model-name", "tiny", "--tensor-parallel-size", "1",
                                  "--gpu-memory-utilization", "0.3", "--enable-sleep-mode",
                                  "--max-model-len", "512"])
    assert (ns.model, ns.host, ns.port, ns.served_model_name) == ("/m/tiny", "10.0.0.1", 8123, ["tiny"])
    assert ns.tensor_parallel_size == 1 and ns.gpu_memory_utilization == 0.3 and ns.enable_sleep_mode
    assert unknown == ["--max-model-len", "512"]
    assert sv.parse_serve(["serve", "m"])[0].gpu_memory_utilization == 0.9  # vLLM's default
    with pytest.raises(sv.Refused):
        sv.parse_serve(["--version"])


def test_cuda_visible_devices_are_integers_as_vllm_maps_them() -> None:
    assert sv.visible_devices("3,1") == [3, 1]
    assert sv.visible_devices("") is None and sv.visible_devices(None) is None
    with pytest.raises(sv.Refused, match=r"Non-integer device ID 'GPU-1234' is not supported by cuda\."):
        sv.visible_devices("0,GPU-1234")


@given(st.text(max_size=40))
def test_cuda_visible_devices_never_raise_anything_else(value: str) -> None:
    try:
        out = sv.visible_devices(value)
    except sv.Refused:
        return
    assert out is None or all(isinstance(i, int) for i in out)


def test_uuids_compared_in_order_without_nvmls_prefix() -> None:
    assert sv.uuid_problem(["fake0000-0000-0000-0000-000000000000"], UUID0) == ""
    assert "LLMGW_GPU_UUIDS says" in sv.uuid_problem([UUID0, UUID1], f"{UUID1},{UUID0}")
    assert "not set" in sv.uuid_problem([UUID0], None)


def test_free_memory_rule_and_text_are_vllms() -> None:
    assert sv.request_memory(30 * GIB, 80 * GIB, 0.3) == 24 * GIB
    with pytest.raises(sv.Refused) as err:
        sv.request_memory(10 * GIB, 80 * GIB, 0.3)
    assert str(err.value) == (
        "Free memory on device cuda:0 (10.0/80.0 GiB) on startup is less than desired GPU memory "
        "utilization (0.3, 24.0 GiB). Decrease GPU memory utilization or reduce GPU memory used by "
        "other processes.")


# -- fake-CUDA mode, as a process -----------------------------------------------------------


def _state(tmp: Path, processes: dict[str, list[list[int]]] | None = None) -> Path:
    state = tmp / "nvml.json"
    state.write_text(json.dumps({"gpus": 2, "total_mib": 81920, "processes": processes or {}}))
    return state


def _run(state: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(STANDIN), "serve", "m", "--port", str(free_port()), *args],
                          env={"PATH": "/usr/bin:/bin", "LLMGW_STANDIN_FAKE_CUDA": str(state), **env},
                          capture_output=True, text=True, timeout=30)


def test_refuses_as_vllm_would(tmp_path: Path) -> None:
    state = _state(tmp_path, {"1": [[1, 70000]]})  # pid 1 (always alive) holds GPU 1
    busy = _run(state, {"CUDA_VISIBLE_DEVICES": "1", "LLMGW_GPU_UUIDS": UUID1},
                "--gpu-memory-utilization", "0.3", "--some-new-flag")
    assert busy.returncode == 1 and "--some-new-flag" in busy.stdout
    assert "is less than desired GPU memory utilization (0.3, 24.0 GiB)" in busy.stderr
    wrong = _run(state, {"CUDA_VISIBLE_DEVICES": "0", "LLMGW_GPU_UUIDS": UUID1})
    assert wrong.returncode == 1 and "LLMGW_GPU_UUIDS says" in wrong.stderr
    named = _run(state, {"CUDA_VISIBLE_DEVICES": UUID0, "LLMGW_GPU_UUIDS": UUID0})
    assert named.returncode == 1 and "Non-integer device ID" in named.stderr
    wide = _run(state, {"CUDA_VISIBLE_DEVICES": "0", "LLMGW_GPU_UUIDS": UUID0}, "--tensor-parallel-size", "2")
    assert wide.returncode == 1 and "world size 2" in wide.stderr


def _post(url: str) -> Any:
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_holds_its_budget_serves_sleeps_and_gives_memory_back_when_killed(tmp_path: Path) -> None:
    fake = _load("gpu_check_fake_pynvml_t", BENCH / "gpu_check_fake_nvml" / "pynvml.py")
    state = _state(tmp_path)
    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "LLMGW_STANDIN_FAKE_CUDA": str(state), "CUDA_VISIBLE_DEVICES": "1",
           "LLMGW_GPU_UUIDS": UUID1, "VLLM_SERVER_DEV_MODE": "1"}
    p = subprocess.Popen([sys.executable, str(STANDIN), "serve", "m", "--port", str(port),
                          "--gpu-memory-utilization", "0.3", "--enable-sleep-mode"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def held() -> dict[int, int]:
            return {i: mib for pid, gpus in fake.holdings(str(state)).items() if pid == p.pid
                    for i, mib in gpus.items()}

        base = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                with urllib.request.urlopen(base + "/health", timeout=1):
                    break
            except OSError:
                time.sleep(0.05)
        assert held() == {1: 24576}  # NVML index 1, the budget (its fake context inside it)
        assert _post(base + "/sleep?level=1")["level"] == 1
        assert held() == {1: sv.FAKE_CONTEXT_MIB}  # weights and KV cache freed, the context kept
        _post(base + "/wake_up")
        assert held() == {1: 24576}
    finally:
        p.kill()
        p.wait(timeout=10)
    assert held() == {}  # a dead holder holds nothing: the fake NVML drops it


# -- torch mode, against a fake torch ------------------------------------------------------

FAKE_TORCH = '''
"""A fake torch for the stand-in's torch path: one 80 GiB device whose free memory and
UUID come from FAKE_TORCH_FREE_GIB and FAKE_TORCH_UUID; what is held is logged."""
import json, os
from types import SimpleNamespace

uint8 = "uint8"
_held = []


def _log(event, n=0):
    with open(os.environ["FAKE_TORCH_LOG"], "a") as f:
        f.write(json.dumps([event, n]) + "\\n")


class _Cuda:
    def is_available(self):
        return True

    def device_count(self):
        return len(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(","))

    def get_device_properties(self, i):
        return SimpleNamespace(uuid=os.environ["FAKE_TORCH_UUID"])  # torch prints no "GPU-"

    def set_device(self, i):
        _log("set_device", i)

    def mem_get_info(self, i):
        return int(float(os.environ["FAKE_TORCH_FREE_GIB"]) * 2**30), 80 * 2**30

    def synchronize(self, i=None):
        pass

    def empty_cache(self):
        _log("empty_cache")


cuda = _Cuda()


def zeros(n, device=None):
    _log("context")


def empty(n, dtype=None, device=None):
    _log("empty", n)
    return SimpleNamespace(numel=lambda: n)
'''


def _fake_torch(tmp: Path) -> Path:
    (tmp / "torch").mkdir(parents=True)
    (tmp / "torch" / "__init__.py").write_text(FAKE_TORCH)
    return tmp


def _events(log: Path) -> list[list[Any]]:
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def test_torch_mode_compares_torchs_uuid_and_holds_the_budget(tmp_path: Path) -> None:
    root = _fake_torch(tmp_path / "site")
    log = tmp_path / "torch.log"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), "FAKE_TORCH_LOG": str(log),
           "FAKE_TORCH_UUID": "5b7f0c2e-aaaa-bbbb-cccc-000000000001", "CUDA_VISIBLE_DEVICES": "0"}
    argv = [sys.executable, str(STANDIN), "serve", "m", "--gpu-memory-utilization", "0.3"]

    def run(**more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*argv, "--port", str(free_port())], env={**env, **more},
                              capture_output=True, text=True, timeout=30)

    wrong = run(FAKE_TORCH_FREE_GIB="79", LLMGW_GPU_UUIDS="GPU-5b7f0c2e-aaaa-bbbb-cccc-000000000002")
    assert wrong.returncode == 1 and "LLMGW_GPU_UUIDS says" in wrong.stderr
    short = run(FAKE_TORCH_FREE_GIB="20", LLMGW_GPU_UUIDS="GPU-5b7f0c2e-aaaa-bbbb-cccc-000000000001")
    assert short.returncode == 1 and "(20.0/80.0 GiB) on startup is less than desired" in short.stderr
    assert [e for e in _events(log) if e[0] == "empty"] == []  # refused before holding anything

    log.unlink()
    port = free_port()
    p = subprocess.Popen([*argv, "--port", str(port), "--enable-sleep-mode"],
                         env={**env, "FAKE_TORCH_FREE_GIB": "79", "VLLM_SERVER_DEV_MODE": "1",
                              "LLMGW_GPU_UUIDS": "GPU-5b7f0c2e-aaaa-bbbb-cccc-000000000001"},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except OSError:
                time.sleep(0.05)
        _post(f"http://127.0.0.1:{port}/sleep?level=1")
        _post(f"http://127.0.0.1:{port}/wake_up")
    finally:
        p.kill()
        p.wait(timeout=10)
    budget = 24 * GIB  # ceil(80 GiB x 0.3); NVML (absent here) would have counted the context
    assert [e for e in _events(log) if e[0] in ("context", "empty", "empty_cache")] == [
        ["context", 0], ["empty", budget], ["empty_cache", 0], ["empty", budget]]

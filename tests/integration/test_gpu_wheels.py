"""bench/gpu_wheels.py: the wheels that travel to the GPU machine (no network there).
Its folder must install into a fresh venv with --no-index, and llmgw's CLI and the GPU
check's modules import there (before issue 30 the check needed openai, trio, pyzmq...).
About 15 s here; skipped where no package index answers (the script needs one)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import gpu_wheels  # noqa: E402


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0].lower().replace("-", "_")


def test_downloads_every_runtime_dependency_for_the_target_python(tmp_path: Path) -> None:
    reqs = gpu_wheels.runtime_requirements()
    assert {_name(r) for r in reqs} >= {"trio", "pyzmq", "attrs", "cattrs", "msgpack", "pyyaml"}
    assert not {_name(r) for r in reqs} & {"openai", "pytest", "torch"}  # the check needs none
    argv = gpu_wheels.download_argv(reqs, "3.12", tmp_path)
    assert argv[argv.index("--python-version") + 1] == "3.12" and "--only-binary=:all:" in argv
    assert "manylinux2014_x86_64" in argv and argv[-len(reqs):] == reqs
    text = gpu_wheels.report([("a.whl", 3 << 20), ("b.whl", 1 << 20)], 4 << 20, 64)
    assert "4.00 MiB  total, 2 wheels (within the 64 MiB" in text
    assert "OVER" in gpu_wheels.report([("a.whl", 65 << 20)], 65 << 20, 64)


def _index_answers(dest: Path) -> bool:
    p = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--dest", str(dest), "sniffio"],
                       capture_output=True, text=True, timeout=60, check=False)
    return p.returncode == 0


@pytest.mark.slow
def test_the_folder_installs_offline_into_a_fresh_venv(tmp_path: Path) -> None:
    if not _index_answers(tmp_path / "probe"):
        pytest.skip("no package index answers here: bench/gpu_wheels.py needs one")
    out = tmp_path / "wheels"
    made = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_wheels.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=180, check=False)
    assert made.returncode == 0, made.stderr[-2000:]
    files, total = gpu_wheels.listing(out)
    names = {f.split("-")[0].lower() for f, _n in files}
    assert "llmgw" in names and {"trio", "pyzmq", "cattrs", "nvidia_ml_py"} <= names
    assert total < gpu_wheels.LIMIT_MIB << 20 and "total" in made.stdout
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    inst = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", "--no-index",
                           "--find-links", str(out), "llmgw"], capture_output=True, text=True,
                          timeout=180, check=False)
    assert inst.returncode == 0, inst.stderr[-2000:]
    run = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "import llmgw.cli, llmgw.simengine.server; print('ok')"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert run.stdout.strip() == "ok", run.stderr[-2000:]
    # The check itself imports there: nothing of the test tier (openai, pytest, h11) is needed.
    check = subprocess.run([str(venv / "bin" / "python"), "-c",
                            f"import sys; sys.path[:0] = [{str(REPO / 'bench')!r}, {str(REPO / 'tests')!r}]; "
                            "import gpu_check, gpu_check_live, gpu_check_probes, gpu_check_vllm; print('ok')"],
                           capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path)
    assert check.stdout.strip() == "ok", check.stderr[-2000:]

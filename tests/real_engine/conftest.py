"""The real-engine tier: vLLM's CPU build, in a virtual environment of its own, serving a
tiny Llama the tests make. Skipped, with one line saying how, unless LLMGW_VLLM_VENV names
that environment; with LLMGW_REQUIRE_REAL_ENGINE=1 (as .ci/run sets) a missing one fails.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

VENV_ENV = "LLMGW_VLLM_VENV"
REQUIRE_ENV = "LLMGW_REQUIRE_REAL_ENGINE"
HERE = Path(__file__).resolve().parent
HOW = (f"real-engine tier: no vLLM venv ({VENV_ENV} unset); get one and run it with: "
       f"tests/real_engine/install_vllm.sh && {VENV_ENV}=$PWD/.ci-vllm-venv "
       "pytest -m real_engine tests/real_engine")


def _venv() -> Path:
    value = os.environ.get(VENV_ENV, "")
    problem = ""
    if not value:
        problem = HOW
    elif not (Path(value) / "bin" / "vllm").exists():
        problem = f"{VENV_ENV}={value} has no bin/vllm; make it with tests/real_engine/install_vllm.sh"
    if problem:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {problem}", pytrace=False)
        pytest.skip(problem)
    return Path(value)


_NOT_RUN: list[int] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without the venv (and not required), the tier is left out with ONE line saying how
    (pytest_terminal_summary), rather than one skip line per test."""
    if os.environ.get(VENV_ENV) or os.environ.get(REQUIRE_ENV) == "1":
        return
    mine = [i for i in items if HERE in Path(str(i.path)).parents]
    if mine:
        items[:] = [i for i in items if i not in mine]
        config.hook.pytest_deselected(items=mine)
        _NOT_RUN.append(len(mine))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _NOT_RUN:
        terminalreporter.write_line(f"SKIPPED {sum(_NOT_RUN)} tests: {HOW}")


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    return _venv()


@pytest.fixture(autouse=True)
def _needs_vllm_venv(vllm_venv: Path) -> None:
    """Every test here needs the venv: one skip reason, one summary line."""


@pytest.fixture(scope="session")
def tiny_model(vllm_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with random weights and a locally trained tokenizer, made once per run
    (with the vLLM venv's python: torch and transformers live there, not in the test venv)."""
    out = tmp_path_factory.mktemp("tiny-llama")
    t0 = time.monotonic()
    r = subprocess.run([str(vllm_venv / "bin" / "python"), str(HERE / "make_model.py"), str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"tiny model made in {time.monotonic() - t0:.1f}s: {r.stdout.strip()}")
    return out

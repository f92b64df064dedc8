"""The wheel ships conf/ and systemd/ as data files, and an installed llmgw (no checkout
beside it) prints them with `llmgw config example`. Offline: the venv's own setuptools
builds it (--no-build-isolation), from a copy so that the checkout gets no build/."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from llmgw import examples

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _copy_source(dst: Path) -> Path:
    ignore = shutil.ignore_patterns(".git", ".venv", ".ci-*", "build", "dist", "*.egg-info",
                                    "__pycache__", ".*_cache", ".hypothesis", "tests", "bench")
    shutil.copytree(REPO, dst, ignore=ignore)
    return dst


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    src = _copy_source(work / "src")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "--no-index", "-q", "-w", str(work / "dist"), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (work / "dist").glob("llmgw-*.whl")
    return whl


def test_the_wheel_holds_every_example_and_the_readme(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        data = next(n.split("/data/")[0] for n in names if ".data/data/" in n) + "/data/"
        for ex in examples.EXAMPLES:
            shipped = data + "share/llmgw/" + ex.relpath
            assert shipped in names, shipped
            assert z.read(shipped) == (REPO / ex.relpath).read_bytes()
        assert z.read(data + "share/doc/llmgw/README.md") == (REPO / "README.md").read_bytes()
        pages = sorted((REPO / "docs").glob("*.md"))
        assert pages
        for page in pages:
            assert z.read(data + "share/doc/llmgw/docs/" + page.name) == page.read_bytes(), page.name


def test_an_installed_llmgw_prints_its_examples(wheel: Path, tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                        # never uninstall the llmgw of the running venv (pip would, for --prefix)
                        "--ignore-installed",
                        "--prefix", str(prefix), str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert importlib.metadata.distribution("llmgw").files, "the running venv lost its llmgw"
    site = Path(sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)}))
    assert (site / "llmgw" / "examples.py").is_file()
    # The installed package comes first on the path, and its dist-info before the checkout's.
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = [sys.executable, "-c", "import sys, llmgw.cli; sys.exit(llmgw.cli.main())"]
    where = subprocess.run([sys.executable, "-c", "import llmgw; print(llmgw.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, check=True)
    assert where.stdout.strip().startswith(str(site))
    # Each example from the share/ folder of the prefix, found through the RECORD.
    code = ("from llmgw import examples as e; print('\\n'.join(str(e.locate(x.relpath)) "
            "for x in e.EXAMPLES)); print(e.locate('README.md'))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=60, check=True).stdout.split()
    share = (prefix / "share").resolve()
    assert found == [str(share / "llmgw" / ex.relpath) for ex in examples.EXAMPLES] + [
        str(share / "doc" / "llmgw" / "README.md")]
    for name in ("agent-no-ib", "sysusers"):
        r = subprocess.run([*run, "config", "example", name], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout == examples.example_text(name)

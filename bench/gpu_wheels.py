"""Wheels for the GPU check's machine: llmgw's own and its runtime dependencies', for a
machine with no network and no package index (bench/gpu_check.py; docs/gpus.md, "The GPU check").

Run here, where the package index is reachable:

    .venv/bin/python bench/gpu_wheels.py [--out dist/gpu-wheels] [--python-version 3.11 ...]

then, on the GPU machine, from the same checkout (dist/ travels when named, it is
git-ignored):

    pip install --no-index --find-links dist/gpu-wheels llmgw && python bench/gpu_check.py

The target is Linux x86_64 (manylinux) CPython at each --python-version (default: this
Python's); pip picks the wheels that fit the machine's Python among them, so a machine
whose Python differs from every version given installs nothing: pass its version (more
than one may be given). The total is printed and must stay under --limit MiB (64: what
travels with the working tree), else the exit code is 1. Nothing of the check's own test
tier (pytest, openai) is needed there: the check speaks HTTP through urllib.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "dist" / "gpu-wheels"
LIMIT_MIB = 64
# manylinux tags pip accepts for an x86_64 glibc machine of the last years (glibc 2.17+).
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_28_x86_64")


def runtime_requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """[project] dependencies: what `pip install llmgw` needs, no extra."""
    with open(pyproject, "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def this_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def build_argv(out: Path, python: str = sys.executable) -> list[str]:
    """llmgw's own wheel, from this checkout, with the setuptools installed here (no
    build isolation: no index needed for the build)."""
    return [python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
            "--wheel-dir", str(out), str(REPO)]


def download_argv(requirements: Sequence[str], python_version: str, out: Path,
                  python: str = sys.executable) -> list[str]:
    """The dependencies' wheels (and theirs) for CPython `python_version` on manylinux
    x86_64: binary only, as pip requires with a foreign target."""
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    return [python, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
            "--only-binary=:all:", *plats, "--implementation", "cp",
            "--python-version", python_version, "--dest", str(out), *requirements]


def listing(out: Path) -> tuple[list[tuple[str, int]], int]:
    """(wheel file name, bytes) of each wheel in `out`, sorted, and their total."""
    files = sorted((p.name, p.stat().st_size) for p in out.glob("*.whl"))
    return files, sum(n for _name, n in files)


def report(files: Sequence[tuple[str, int]], total: int, limit_mib: float) -> str:
    lines = [f"{n / (1 << 20):8.2f} MiB  {name}" for name, n in files]
    verdict = "within" if total <= limit_mib * (1 << 20) else "OVER"
    lines.append(f"{total / (1 << 20):8.2f} MiB  total, {len(files)} wheels ({verdict} the "
                 f"{limit_mib:g} MiB that travel with the working tree)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", default=str(OUT), help=f"the folder (default {OUT.relative_to(REPO)})")
    ap.add_argument("--python-version", action="append", default=None,
                    help=f"the GPU machine's CPython, X.Y (default {this_python()}); repeatable")
    ap.add_argument("--limit", type=float, default=LIMIT_MIB, help="MiB the total must stay under")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)  # only wheels this script made: a version left over would mislead
    out.mkdir(parents=True)
    steps = [build_argv(out)] + [download_argv(runtime_requirements(), v, out)
                                 for v in (args.python_version or [this_python()])]
    for cmd in steps:
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if p.returncode != 0:
            print(f"{' '.join(cmd[:4])} ... exited {p.returncode}:\n{(p.stderr or p.stdout)[-2000:]}",
                  file=sys.stderr)
            return 1
    files, total = listing(out)
    print(report(files, total, args.limit))
    shown = out.resolve().relative_to(REPO) if out.resolve().is_relative_to(REPO) else out
    print(f"\non the GPU machine, from the checkout: pip install --no-index --find-links {shown} llmgw")
    return 0 if total <= args.limit * (1 << 20) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The units in systemd/ as systemd itself reads them: `systemd-analyze verify` accepts all
three, and `systemd-analyze security --offline=yes` rates the server and the router 5.0
or better (lower is safer). The agent's sandbox is light on purpose (its unit says why).

verify checks that ExecStart's program exists, so the units are checked from copies whose
/usr/local/bin/llmgw is the llmgw of this venv.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from llmgw import examples

REPO = Path(__file__).resolve().parents[2]
UNITS = ("llmgw-server.service", "llmgw-agent.service", "llmgw-router.service")
INSTALLED = "/usr/local/bin/llmgw"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def _llmgw() -> Path:
    found = Path(sys.executable).parent / "llmgw"
    if not found.is_file():
        pytest.skip(f"no llmgw script beside {sys.executable} (pip install -e . makes it)")
    return found


@pytest.fixture
def units(tmp_path: Path) -> Path:
    for name in UNITS:
        text = (REPO / "systemd" / name).read_text()
        assert f"ExecStart={INSTALLED} " in text, name
        (tmp_path / name).write_text(text.replace(INSTALLED, str(_llmgw())))
    return tmp_path


@needs_analyze
def test_verify_accepts_every_unit(units: Path) -> None:
    assert ANALYZE is not None
    r = subprocess.run([ANALYZE, "verify", *(str(units / u) for u in UNITS)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout + r.stderr == "", r.stdout + r.stderr


def exposure(unit: Path) -> float:
    assert ANALYZE is not None
    r = subprocess.run([ANALYZE, "security", "--offline=yes", str(unit)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout + r.stderr)
    assert m, r.stdout + r.stderr
    return float(m.group(1))


@needs_analyze
@pytest.mark.parametrize("name", ["llmgw-server.service", "llmgw-router.service"])
def test_server_and_router_are_rated_5_or_better(units: Path, name: str) -> None:
    level = exposure(units / name)
    assert level <= 5.0, f"{name}: exposure {level}"
    # The figure the unit's comment quotes is the one systemd gives.
    assert f"rates it {level:.1f} OK" in (REPO / "systemd" / name).read_text()


@needs_analyze
def test_the_agent_keeps_what_its_engines_need(units: Path) -> None:
    text = (REPO / "systemd" / "llmgw-agent.service").read_text()
    settings = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and line[0] != "#")
    assert settings["KillMode"] == "process" and "User" not in settings
    # Engines inherit these and outlive the agent (the unit's comment says why each).
    for kept_out in ("PrivateTmp", "ProtectSystem", "ProtectHome", "PrivateDevices", "DevicePolicy",
                     "ProtectClock", "MemoryDenyWriteExecute", "RestrictAddressFamilies",
                     "SystemCallFilter"):
        assert kept_out not in settings, kept_out
    assert f"rates it {exposure(units / 'llmgw-agent.service'):.1f};" in text


def test_services_run_as_the_user_the_sysusers_file_makes() -> None:
    sysusers = (REPO / "systemd" / "llmgw.sysusers.conf").read_text()
    (entry,) = [line.split() for line in sysusers.splitlines() if line.startswith("u ")]
    for name in ("llmgw-server.service", "llmgw-router.service"):
        text = (REPO / "systemd" / name).read_text()
        assert f"User={entry[1]}\n" in text and f"Group={entry[1]}\n" in text


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers is not installed")
def test_the_sysusers_file_creates_the_llmgw_user(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    conf = REPO / "systemd" / "llmgw.sysusers.conf"
    r = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(conf)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^llmgw:x:\d+:\d+:.*:/usr/sbin/nologin$",
                     (tmp_path / "etc" / "passwd").read_text(), re.M)
    assert re.search(r"^llmgw:x:\d+:", (tmp_path / "etc" / "group").read_text(), re.M)


def test_documentation_is_the_readme_pip_installs_beside_the_program() -> None:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    assert data["share/doc/llmgw"] == ["README.md"]
    # The pages the README links to, beside it (its links are relative: docs/NAME.md).
    assert data["share/doc/llmgw/docs"] == ["docs/*.md"]
    prefix = INSTALLED.removesuffix("/bin/llmgw")
    for name in UNITS:
        text = (REPO / "systemd" / name).read_text()
        assert re.findall(r"^Documentation=(.*)$", text, re.M) == [
            f"file://{prefix}/share/doc/llmgw/README.md"], name


def test_install_comments_name_examples_that_exist() -> None:
    for name in UNITS:
        text = (REPO / "systemd" / name).read_text()
        named = re.findall(r"llmgw config example (\S+)", text)
        assert named, name
        assert set(named) <= set(examples.BY_NAME), name
        assert "cp conf/" not in text

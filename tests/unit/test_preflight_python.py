"""Which Python runs the pre-flight probe (issue 30 item 4): the engine's own, read from
`engines.vllm.bin`'s head whatever form pip or a user gave it — `#!/path/python`,
`#!/usr/bin/env python3` (looked up on PATH), pip's `/bin/sh` trampoline (written when the
shebang would pass 127 bytes or holds a space) or uv's relocatable one — and a `required`
pre-flight with none found is refused with the reason, never skipped without a word."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.discovery.engine_check import find_python
from llmgw.agent.discovery.engine_meta import HEAD_MAX, ScriptPython, script_python
from llmgw.agent.engines import build_plan
from llmgw.agent.insession import preflight_run
from llmgw.agent.process.spawn import probe_command
from llmgw.config.agent import AgentConfig, EnginesConfig, KeysConfig, SupervisorConfig, VllmConfig
from llmgw.errors import EngineError
from llmgw.model.engine import EngineKind, EngineSpec, GangSpec


def pip_trampoline(python: bytes) -> bytes:
    """What pip's distlib (ScriptMaker._build_shebang) writes for a long or spaced path:
    the path quoted when it holds a space (enquote_executable), bare otherwise."""
    exe = b'"' + python + b'"' if b" " in python else python
    return (b"#!/bin/sh\n'''exec' " + exe + b' "$0" "$@"\n' + b"' '''\n"
            b"# -*- coding: utf-8 -*-\nimport re\nimport sys\nfrom vllm.entrypoints.cli.main import main\n")


UV_TRAMPOLINE = (b"#!/bin/sh\n'''exec' \"$(dirname -- \"$(realpath -- \"$0\")\")\"/'python' \"$0\" \"$@\"\n"
                 b"' '''\nimport sys\n")
LONG = b"/scratch/" + b"x" * 130 + b"/venv/bin/python3.12"


@pytest.mark.parametrize("head, want", [
    (b"#!/opt/venv/bin/python3.12\nimport sys\n", ScriptPython("path", "/opt/venv/bin/python3.12")),
    (b"#!/opt/venv/bin/python3 -E -s\n", ScriptPython("path", "/opt/venv/bin/python3")),
    (b"#!/usr/bin/env python3\n", ScriptPython("env", "python3")),
    (b"#!/usr/bin/env -S python3.11 -u\n", ScriptPython("env", "python3.11")),
    (b"#!/usr/bin/env PYTHONNOUSERSITE=1 python3\n", ScriptPython("env", "python3")),
    (pip_trampoline(LONG), ScriptPython("path", LONG.decode())),
    (pip_trampoline(b"/opt/my env/bin/python"), ScriptPython("path", "/opt/my env/bin/python")),
    (UV_TRAMPOLINE, ScriptPython("beside", "python")),
    (b"#!/usr/bin/env bash\nexec vllm\n", None),
    (b"#!/bin/sh\nexec /opt/venv/bin/python -m vllm \"$@\"\n", None),  # a plain shell script
    (b"#!/bin/sh\n'''exec' \"/unterminated\n", None),
    (b"\x7fELF\x02\x01\x01", None),
    (b"#!\n", None),
    (b"", None),
])
def test_the_heads_a_console_script_may_have(head: bytes, want: ScriptPython | None) -> None:
    assert script_python(head) == want


_PATH_CHARS = st.characters(blacklist_characters="\"'\n\r\t\0", blacklist_categories=("Cs", "Zl", "Zp"))


@given(st.lists(st.text(_PATH_CHARS, min_size=1, max_size=40).filter(
           lambda s: "/" not in s and s.strip() == s and s not in (".", "..")), min_size=1, max_size=6),
       st.sampled_from(["python", "python3", "python3.12"]))
def test_pips_trampoline_gives_back_the_python_it_was_made_for(dirs: list[str], name: str) -> None:
    python = "/" + "/".join([*dirs, "bin", name])
    assert script_python(pip_trampoline(python.encode())) == ScriptPython("path", python)


@given(st.binary(max_size=HEAD_MAX + 64))
def test_any_bytes_get_an_answer(head: bytes) -> None:
    got = script_python(head)
    assert got is None or (got.kind in ("path", "env", "beside") and "python" in got.name)
    tramp = script_python(b"#!/bin/sh\n'''exec' " + head)  # total on a trampoline's line too
    assert tramp is None or "python" in tramp.name


def _script(path: Path, head: bytes) -> str:
    path.write_bytes(head)
    path.chmod(0o755)
    return str(path)


def test_the_shell_follows_env_and_trampolines_to_a_python(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    py = _script(bindir / "python3", b"#!/bin/sh\n")
    assert find_python(_script(tmp_path / "a", b"#!/usr/bin/env python3\n"), str(bindir)) == (py, "")
    assert find_python(_script(tmp_path / "b", pip_trampoline(b"/opt/v/bin/python"))) == ("/opt/v/bin/python", "")
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    assert find_python(_script(venv / "vllm", UV_TRAMPOLINE)) == (str(venv / "python"), "")
    none, why = find_python(_script(tmp_path / "c", b"#!/usr/bin/env python3\n"), str(tmp_path / "empty"))
    assert none == "" and why.endswith("runs `env python3`, and python3 is not on PATH"), why
    assert find_python(_script(tmp_path / "d", b"\x7fELF"))[1].endswith("names no Python in its first line")
    assert find_python(sys.executable) == (sys.executable, "")


def config(tmp_path: Path, vllm_bin: str) -> AgentConfig:
    return AgentConfig(node_id="n1", server="tcp://10.0.0.9:5555", keys=KeysConfig("s", "p"),
                       mgmt_addr="10.0.0.2", mgmt_interface="eno1",
                       engines=EnginesConfig(vllm=VllmConfig(bin=vllm_bin, launch_mode="mp")),
                       supervisor=SupervisorConfig(work_dir=str(tmp_path)))


def spec(preflight: str = "required") -> EngineSpec:
    gang = GangSpec(2, 1, "10.0.0.1", 29600, ("mlx5_0",), preflight=preflight, preflight_timeout=45.0)
    return EngineSpec("r1", 1, "d", "/m", "m", EngineKind.VLLM, ("GPU-a",), 20001, port_base=20100, gang=gang)


def test_the_probe_runs_under_the_python_of_pips_trampoline(tmp_path: Path) -> None:
    """Before: only a `#!/path/python` first line was read; a trampoline gave "", and the
    gang's probe was dropped."""
    vllm = _script(tmp_path / "vllm", pip_trampoline(LONG))
    assert probe_command(spec(), config(tmp_path, vllm), "/agent/python")[0] == LONG.decode()


def test_a_required_preflight_with_no_python_is_refused_saying_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    cfg = config(tmp_path, _script(tmp_path / "vllm", b"#!/usr/bin/env python3\n"))
    probe = probe_command(spec(), cfg, "/agent/python")
    assert probe[0] == ""
    with pytest.raises(EngineError) as e:
        build_plan(spec(), cfg, "/w", gpu_indices={"GPU-a": 0}, probe=probe)
    assert "pre-flight is required, and no Python was found to run the pre-flight probe with " \
           "(engines.vllm.bin names none" in str(e.value) and "engines.preflight_python" in str(e.value)
    # Best effort: the plan carries the probe with no Python; the launcher says so in the
    # log, and the engine starts, as best effort does on any failed probe.
    best = build_plan(spec("best_effort"), cfg, "/w", gpu_indices={"GPU-a": 0}, probe=probe).preflight
    assert best is not None and best.process.argv[0] == "" and not best.required
    doc = {"argv": list(best.process.argv), "env": best.process.env, "cwd": "", "timeout": 5.0,
           "required": False, "result": str(tmp_path / "preflight.json")}
    result = preflight_run.probe(doc)
    assert not result.ok and result.error.startswith("no Python was found to run the probe with")
    assert preflight_run.run(doc)

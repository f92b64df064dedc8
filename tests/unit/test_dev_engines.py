"""`llmgw dev --vllm-bin / --sglang-python`: written into the agent config, checked, and
named truthfully in the startup line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from llmgw.dev import _engine_line
from llmgw.dev_config import DevOptions, check_options, write_configs
from llmgw.errors import UsageError


def _exe(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_engine_binaries_go_into_the_agent_config(tmp_path: Path) -> None:
    vllm = _exe(tmp_path / "vllm")
    py = _exe(tmp_path / "python")
    opts = DevOptions(router_port=0, vllm_bin=str(vllm), sglang_python=str(py))
    check_options(opts)
    files = write_configs(tmp_path / "dev", opts, 0)
    agent = yaml.safe_load(files.agent_yaml.read_text())
    assert agent["engines"] == {"vllm": {"bin": str(vllm)}, "sglang": {"python": str(py)}}
    assert _engine_line("vLLM", "--vllm-bin", str(vllm), "vllm") == f"vLLM deployments run {vllm} (--vllm-bin)"


def test_without_them_the_agent_config_has_no_engines_section(tmp_path: Path) -> None:
    files = write_configs(tmp_path / "dev", DevOptions(router_port=0), 0)
    assert "engines" not in yaml.safe_load(files.agent_yaml.read_text())


def test_a_missing_or_non_executable_binary_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--vllm-bin .*not an executable"):
        check_options(DevOptions(router_port=0, vllm_bin=str(tmp_path / "nope")))
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(UsageError, match="--sglang-python"):
        check_options(DevOptions(router_port=0, sglang_python=str(plain)))


def test_the_startup_line_says_when_vllm_is_not_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "not on PATH (--vllm-bin names one)" in _engine_line("vLLM", "--vllm-bin", "", "vllm")
    _exe(tmp_path / "vllm")
    assert _engine_line("vLLM", "--vllm-bin", "", "vllm").startswith(
        f"vLLM deployments run {os.path.join(tmp_path, 'vllm')} (from PATH")

"""Every operator mistake ends in one message and exit status 2, never a traceback."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from llmgw.cli import build_parser, main, usage_message
from llmgw.ctl.commands import normalize, op_of
from llmgw.errors import (
    EXIT_FAILED,
    EXIT_IDENTITY,
    EXIT_INTERRUPTED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    HandshakeError,
    ListenError,
    RefusedError,
    RequestFailedError,
    ServerUnreachableError,
    UsageError,
)
from llmgw.transport import keys
from llmgw.transport.requests import DescribeOp, DescribeWhat, GetOp, GetWhat, LogsOp


@pytest.fixture
def good(tmp_path: Path) -> dict[str, object]:
    keys.init_keys(str(tmp_path / "k"))
    keys.issue_key(str(tmp_path / "k"), "node", "gpu-a-01")
    return {
        "node_id": "gpu-a-01",
        "server": "tcp://127.0.0.1:7443",
        "keys": {"secret_key": str(tmp_path / "k" / "gpu-a-01.key_secret"),
                 "server_key": str(tmp_path / "k" / "server.key")},
        "mgmt_addr": "10.0.0.11",
        "fabrics": [{"name": "ib-a", "hcas": ["mlx5_0"]}, {"name": "ib-b", "hcas": ["mlx5_1"]}],
    }


CASES = [
    ("unknown key", {"colour": "blue"}, ["colour"]),
    ("wrong type", {"heartbeat_interval": [1]}, ["heartbeat_interval"]),
    ("bad duration", {"reconnect_max": "soon"}, ["reconnect_max", "soon"]),
    ("missing key file", {"keys": {"secret_key": "/nope/x.key_secret", "server_key": "/nope/s.key"}},
     ["keys.secret_key", "/nope/x.key_secret"]),
    ("fabric without hcas", {"fabrics": [{"name": "ib-a", "hcas": ["mlx5_0"]}, {"name": "ib-b", "hcas": []}]},
     ["fabrics[1].hcas"]),
    ("two fabrics one name", {"fabrics": [{"name": "ib-a", "hcas": ["mlx5_0"]}, {"name": "ib-a", "hcas": ["mlx5_1"]}]},
     ["fabrics[1].name", "ib-a"]),
    ("hca in two fabrics", {"fabrics": [{"name": "ib-a", "hcas": ["mlx5_0"]}, {"name": "ib-b", "hcas": ["mlx5_0"]}]},
     ["mlx5_0"]),
    ("http server", {"server": "https://x:7443"}, ["server", "https://x:7443"]),
]


@pytest.mark.parametrize(("what", "change", "needles"), CASES, ids=[c[0] for c in CASES])
def test_agent_config_errors_exit_2(tmp_path: Path, good: dict[str, object], what: str,
                                    change: dict[str, object], needles: list[str],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({**good, **change}))
    assert main(["agent", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err
    for needle in needles:
        assert needle in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_server_config_error_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "server.toml"
    path.write_text(f'keys_dir = "{tmp_path}/missing"\nlost_after = "forever"\n')
    assert main(["server", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "Traceback" not in err


def test_missing_config_file_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["agent", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml" in capsys.readouterr().err


def test_usage_error_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["agent"]) == 2
    assert "--config" in capsys.readouterr().err
    assert main(["keys", "issue", "wizard", "x", "--dir", "/tmp"]) == 2


# ---- the command line itself (issue 13) ----

LLMGW = [sys.executable, "-m", "llmgw.cli"]


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LLMGW, *args], capture_output=True, text=True, timeout=30,
                          env={**os.environ, **(env or {})})


def test_exit_codes_are_the_documented_ones() -> None:
    assert (EXIT_FAILED, EXIT_USAGE, EXIT_IDENTITY, EXIT_UNREACHABLE, EXIT_INTERRUPTED) == (1, 2, 3, 4, 130)
    assert RequestFailedError("x").exit_code == 1
    assert UsageError("x").exit_code == ListenError("x").exit_code == 2
    assert RefusedError("x").exit_code == HandshakeError("x").exit_code == 3
    assert ServerUnreachableError("x").exit_code == 4


def test_version_and_bare_commands_print_help() -> None:
    r = _run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"llmgw {version('llmgw')}"
    for args in ((), ("ctl",), ("keys",)):
        r = _run(*args)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("usage: llmgw") and r.stderr == ""
    r = _run("ctl", "--help")
    assert "ctl.toml" in r.stdout and "LLMGW_SERVER" in r.stdout


@pytest.mark.parametrize(("args", "needles"), [
    (["frob"], ["unknown command 'frob'", "llmgw --help"]),
    (["ctl", "get"], ["ctl get: the following arguments are required: KIND"]),
    (["ctl", "status", "-o", "xml"], ["ctl status: -o/--output: 'xml' is not one of table, wide, json, yaml"]),
    (["ctl", "status", "--timeout", "-1"], ["--timeout: expected seconds greater than 0"]),
    (["ctl", "--server", "http://127.0.0.1:7443", "--key", "k", "--server-key", "s", "status"],
     ["--server 'http://127.0.0.1:7443': expected tcp://HOST:PORT"]),
    (["ctl", "--server", "127.0.0.1:7443", "--key", "k", "--server-key", "s", "status"],
     ["--server '127.0.0.1:7443': expected tcp://HOST:PORT"]),
    (["ctl", "--server", "tcp://h:1", "--key", "k", "--server-key", "s", "get", "pods"],
     ["ctl get: unknown kind 'pods'"]),
    (["ctl", "--server", "tcp://h:1", "--key", "k", "--server-key", "s", "logs", "r", "-n", "0"],
     ["-n/--lines: expected 1 to"]),
])
def test_usage_errors_are_one_line_exit_2(args: list[str], needles: list[str]) -> None:
    r = _run(*args, env={"XDG_CONFIG_HOME": "/nonexistent"})
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("llmgw: "), err
    assert "argument " not in err and "error:" not in err and "Traceback" not in err
    for needle in needles:
        assert needle in err


def test_usage_message_drops_argparse_internals() -> None:
    assert usage_message("llmgw ctl get", "argument -o/--output: invalid choice: 'x' "
                         "(choose from 'table', 'json')") == \
        "ctl get: -o/--output: 'x' is not one of table, json (see `llmgw ctl get --help`)"
    assert usage_message("llmgw", "argument COMMAND: invalid choice: 'x' (choose from 'a', 'b')") \
        == "unknown command 'x' (choose from a, b) (see `llmgw --help`)"


def _ctl_args(*argv: str) -> argparse.Namespace:
    return normalize(build_parser().parse_args(["ctl", *argv]))


def test_options_before_or_after_the_verb() -> None:
    before = _ctl_args("-o", "json", "--timeout", "2", "--server", "tcp://a:1", "status")
    after = _ctl_args("status", "-o", "json", "--timeout", "2", "--server", "tcp://a:1")
    for a in (before, after):
        assert (a.output, a.timeout, a.server) == ("json", 2.0, ["tcp://a:1"])
    both = _ctl_args("--server", "tcp://a:1", "-o", "yaml", "get", "no", "--server", "tcp://b:1")
    assert both.server == ["tcp://a:1", "tcp://b:1"] and both.output == "yaml"
    plain = _ctl_args("status")
    assert (plain.output, plain.timeout, plain.server) == ("table", 5.0, None)
    assert build_parser().parse_args(["-v", "ctl", "status"]).verbose is True


@pytest.mark.parametrize(("argv", "op"), [
    (["get", "deploy"], GetOp(GetWhat.DEPLOYMENTS)),
    (["get", "deployment", "x"], GetOp(GetWhat.DEPLOYMENTS)),
    (["get", "replica"], GetOp(GetWhat.REPLICAS)),
    (["get", "no"], GetOp(GetWhat.NODES)),
    (["describe", "deploy", "d"], DescribeOp("d", DescribeWhat.DEPLOYMENT)),
    (["describe", "node", "n1"], DescribeOp("n1", DescribeWhat.NODE)),
    (["describe", "replicas", "d-0"], DescribeOp("d-0", DescribeWhat.REPLICA)),
    (["logs", "d-0", "-n", "7"], LogsOp("d-0", 7)),
    (["logs", "d-0", "-f", "-n", "7"], LogsOp("d-0", 1000)),
])
def test_kinds_and_ops(argv: list[str], op: object) -> None:
    assert op_of(_ctl_args(*argv)) == op


def test_delete_takes_only_deployments() -> None:
    with pytest.raises(UsageError, match="unknown kind 'node'"):
        op_of(_ctl_args("delete", "node", "n1"))


def test_broken_pipe_ends_quietly(tmp_path: Path) -> None:
    keys.init_keys(str(tmp_path))
    for i in range(300):
        keys.issue_key(str(tmp_path), "admin", f"op{i}")
    p = subprocess.Popen([*LLMGW, "keys", "list", "--dir", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # the reader is gone before the first write, as `| head -0` would be
    err = p.stderr.read().decode()
    p.stderr.close()
    assert p.wait(timeout=30) == 0, err
    assert err == "", err


IFACE_CASES = [
    ("no such interface", {"mgmt_addr": "127.0.0.1", "mgmt_interface": "nosuch0"},
     ["mgmt_interface", "nosuch0", "no such interface"]),
    ("interface without the address", {"mgmt_addr": "127.0.0.2", "mgmt_interface": "lo"},
     ["mgmt_interface", "lo", "127.0.0.2"]),
    ("address on no interface", {"mgmt_addr": "10.0.0.11"}, ["mgmt_addr", "10.0.0.11"]),
]


@pytest.mark.parametrize(("what", "change", "needles"), IFACE_CASES, ids=[c[0] for c in IFACE_CASES])
def test_agent_bootstrap_interface_errors_exit_2(tmp_path: Path, good: dict[str, object], what: str,
                                                 change: dict[str, object], needles: list[str],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The interface engines bootstrap on is checked against the node at start (issue 18):
    before, a wrong or missing one surfaced only as Gloo's "connectFullMesh failed"."""
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({**good, **change}))
    assert main(["agent", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    for needle in [str(path), *needles]:
        assert needle in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_agent_derives_its_bootstrap_interface_from_mgmt_addr(tmp_path: Path, good: dict[str, object]) -> None:
    from llmgw.agent.run import with_mgmt_interface
    from llmgw.config.load_agent import load_agent_config

    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({**good, "mgmt_addr": "127.0.0.1"}))
    config = load_agent_config(str(path))
    assert config.mgmt_interface == ""
    assert with_mgmt_interface(config).mgmt_interface == "lo"


def test_an_internal_error_ends_with_its_traceback(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A bug of ours (a lifecycle table asked for a row it has not) is no operator's
    mistake: the CLI prints its traceback, then the one line."""
    from llmgw import cli
    from llmgw.agent.lifecycle.states import EngineEvent, next_state

    def bug(args: argparse.Namespace) -> None:
        next_state(None, EngineEvent.HEALTH_OK)

    monkeypatch.setattr(cli, "cmd_agent", bug)
    assert main(["agent", "--config", "agent.yaml"]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in bug" in err
    assert err.rstrip().endswith(
        "llmgw: internal error: engine event 'health_ok' is not valid in state 'not started'")

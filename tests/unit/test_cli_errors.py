"""Every operator mistake ends in one message and exit status 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmgw.cli import main
from llmgw.transport import keys


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

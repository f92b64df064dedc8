"""`llmgw dev --state-dir DIR`: the server keeps its port from run to run, and DIR/ctl.toml
makes the printed ctl line (`llmgw ctl --config DIR/ctl.toml ...`) work every time.
(A whole dev run, and that line run against it: tests/integration/test_dev.py.)"""

from __future__ import annotations

import shlex
import socket
from pathlib import Path

import pytest

from llmgw import dev_config as dev
from llmgw.ctl.settings import resolve


@pytest.fixture(autouse=True)
def no_ctl_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("LLMGW_SERVER", "LLMGW_CTL_KEY", "LLMGW_SERVER_KEY", "LLMGW_CTL_CONFIG"):
        monkeypatch.delenv(var, raising=False)


def test_a_kept_folder_keeps_the_server_port_and_ctl_toml_names_it(tmp_path: Path) -> None:
    first = dev.write_configs(tmp_path, dev.DevOptions(state_dir=str(tmp_path)), 8080)
    again = dev.write_configs(tmp_path, dev.DevOptions(state_dir=str(tmp_path)), 8080)
    assert again.server_address == first.server_address
    assert again.ctl_line("status") == first.ctl_line("status")

    line = shlex.split(first.ctl_line("status"))
    assert line[:4] == ["llmgw", "ctl", "--config", str(tmp_path / "ctl.toml")]
    s = resolve(None, None, None, config=line[3])
    assert (s.server, s.key, s.server_key) == (
        first.server_address, str(tmp_path / "keys" / "dev-admin.key_secret"),
        str(tmp_path / "keys" / "server.key"))
    assert Path(s.key).is_file() and Path(s.server_key).is_file()


def test_a_port_taken_since_the_last_run_is_replaced_and_ctl_toml_follows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = dev.write_configs(tmp_path, dev.DevOptions(state_dir=str(tmp_path)), 8080)
    port = int(first.server_address.rsplit(":", 1)[1])
    with socket.socket() as squatter:
        squatter.bind((dev.HOST, port))
        squatter.listen()
        again = dev.write_configs(tmp_path, dev.DevOptions(state_dir=str(tmp_path)), 8080)
    assert again.server_address != first.server_address
    assert f"({port}) is taken" in capsys.readouterr().out
    assert resolve(None, None, None, config=str(again.ctl_toml)).server == again.server_address


def test_metrics_listeners_get_free_ports_kept_with_the_folder(tmp_path: Path) -> None:
    first = dev.write_configs(tmp_path, dev.DevOptions(state_dir=str(tmp_path)), 8080)
    binds = {first.server_metrics, first.agent_metrics}
    assert len(binds) == 2 and not binds & {"127.0.0.1:9464", "127.0.0.1:9465"}
    assert all(b.startswith(f"{dev.HOST}:") for b in binds)
    again = dev.write_configs(tmp_path, dev.DevOptions(state_dir=str(tmp_path)), 8080)
    assert (again.server_metrics, again.agent_metrics) == (first.server_metrics, first.agent_metrics)
    # The daemons read them from the files dev wrote.
    from llmgw.config.load_agent import load_agent_config
    from llmgw.config.load_server import load_server_config

    assert load_server_config(str(again.server_toml)).metrics_bind == again.server_metrics
    assert load_agent_config(str(again.agent_yaml)).metrics_bind == again.agent_metrics


def test_a_status_page_port_taken_since_the_last_run_is_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = dev.write_configs(tmp_path, dev.DevOptions(state_dir=str(tmp_path)), 8080)
    port = int(first.server_metrics.rsplit(":", 1)[1])
    with socket.socket() as squatter:
        squatter.bind((dev.HOST, port))
        squatter.listen()
        again = dev.write_configs(tmp_path, dev.DevOptions(state_dir=str(tmp_path)), 8080)
    assert again.server_metrics != first.server_metrics
    assert again.agent_metrics == first.agent_metrics
    assert f"the status page's port of the last run ({port}) is taken" in capsys.readouterr().out

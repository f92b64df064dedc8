"""metrics_bind and metrics_token in the shipped server and agent configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq.auth
from test_config_agent import write as agent_write
from test_config_server import expect_error, keys, server  # noqa: F401 - fixture

from llmgw.config.load_agent import load_agent_config
from llmgw.config.load_server import load_server_config
from llmgw.config.metrics import is_loopback, split_host_port

TOKEN = "0123456789abcdef0123"


def test_shipped_defaults_are_loopback(tmp_path: Path, keys: Path) -> None:  # noqa: F811
    cfg = load_server_config(server(tmp_path, keys))
    assert cfg.metrics_bind == "127.0.0.1:9464"
    assert cfg.metrics_token == ""


def test_empty_bind_turns_it_off(tmp_path: Path, keys: Path) -> None:  # noqa: F811
    cfg = load_server_config(server(tmp_path, keys, ('metrics_bind = "127.0.0.1:9464"', 'metrics_bind = ""')))
    assert cfg.metrics_bind == ""


@pytest.mark.parametrize("bind", ["0.0.0.0:9464", "10.0.0.1:9464", "[::]:9464", "metrics.internal:9464"])
def test_reachable_bind_without_token_is_refused(tmp_path: Path, keys: Path, bind: str) -> None:  # noqa: F811
    path = server(tmp_path, keys, ('metrics_bind = "127.0.0.1:9464"', f'metrics_bind = "{bind}"'))
    text = expect_error(load_server_config, path, "metrics_bind", bind)
    assert "metrics_token" in text


def test_reachable_bind_with_token_loads(tmp_path: Path, keys: Path) -> None:  # noqa: F811
    path = server(tmp_path, keys, ('metrics_bind = "127.0.0.1:9464"', 'metrics_bind = "0.0.0.0:9464"'),
                  ('metrics_token = ""', f'metrics_token = "{TOKEN}"'))
    cfg = load_server_config(path)
    assert (cfg.metrics_bind, cfg.metrics_token) == ("0.0.0.0:9464", TOKEN)


@pytest.mark.parametrize("token", ["short", "has a space in it somewhere", "tab\tseparated-0123456789"])
def test_bad_token_is_refused(tmp_path: Path, keys: Path, token: str) -> None:  # noqa: F811
    path = server(tmp_path, keys, ('metrics_token = ""', f'metrics_token = "{token}"'))
    expect_error(load_server_config, path, "metrics_token", "16")


@pytest.mark.parametrize("bind", ["9464", "http://127.0.0.1:9464", "127.0.0.1:99999"])
def test_bad_bind_is_refused(tmp_path: Path, keys: Path, bind: str) -> None:  # noqa: F811
    path = server(tmp_path, keys, ('metrics_bind = "127.0.0.1:9464"', f'metrics_bind = "{bind}"'))
    expect_error(load_server_config, path, "metrics_bind", bind)


def test_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("127.9.9.9") and is_loopback("::1")
    assert is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.0.0.1")
    assert not is_loopback("localhost.evil.example")
    assert split_host_port("[::1]:9464") == ("::1", 9464)


def test_agent_metrics_bind(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    d.mkdir()
    zmq.auth.create_certificates(str(d), "server")
    zmq.auth.create_certificates(str(d), "gpu-a-01")
    assert load_agent_config(agent_write(tmp_path, d)).metrics_bind == "127.0.0.1:9465"
    line = 'metrics_bind: "127.0.0.1:9465"'
    # Agents are scraped over the management network: no token needed, any address.
    assert load_agent_config(agent_write(tmp_path, d, (line, 'metrics_bind: "10.0.0.11:9465"'))
                             ).metrics_bind == "10.0.0.11:9465"
    assert load_agent_config(agent_write(tmp_path, d, (line, 'metrics_bind: ""'))).metrics_bind == ""
    path = agent_write(tmp_path, d, (line, 'metrics_bind: "9465"'))
    expect_error(load_agent_config, path, "metrics_bind", "9465")

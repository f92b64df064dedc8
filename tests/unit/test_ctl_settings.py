from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.ctl.settings import resolve
from llmgw.errors import ConfigError, UsageError


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for var in ("LLMGW_SERVER", "LLMGW_CTL_KEY", "LLMGW_SERVER_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "llmgw").mkdir()
    return tmp_path / "llmgw" / "ctl.toml"


def test_flags_then_environment_then_file(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clean_env.write_text('server = "tcp://file:1"\nkey = "file.key_secret"\nserver_key = "file.key"\n')
    assert resolve(None, None, None).server == "tcp://file:1"
    monkeypatch.setenv("LLMGW_SERVER", "tcp://env:1")
    monkeypatch.setenv("LLMGW_CTL_KEY", "env.key_secret")
    s = resolve(None, None, None)
    assert (s.server, s.key, s.server_key) == ("tcp://env:1", "env.key_secret", "file.key")
    s = resolve("tcp://flag:1", None, None)
    assert (s.server, s.key) == ("tcp://flag:1", "env.key_secret")


def test_unknown_key_in_file(clean_env: Path) -> None:
    clean_env.write_text('sever = "tcp://x:1"\n')
    with pytest.raises(ConfigError, match="sever"):
        resolve(None, None, None)


def test_nothing_anywhere_is_a_usage_error(clean_env: Path) -> None:
    with pytest.raises(UsageError, match="--server-key"):
        resolve("tcp://x:1", "k", None)


@pytest.mark.parametrize("bad", ["http://127.0.0.1:7443", "127.0.0.1:7443", "tcp://a:1,tcp://b"])
def test_server_address_checked_naming_its_source(clean_env: Path, monkeypatch: pytest.MonkeyPatch,
                                                  bad: str) -> None:
    with pytest.raises(UsageError, match=r"^--server .*expected tcp://HOST:PORT"):
        resolve(bad, "k", "s")
    monkeypatch.setenv("LLMGW_SERVER", bad)
    with pytest.raises(UsageError, match=r"^LLMGW_SERVER .*expected tcp://HOST:PORT"):
        resolve(None, "k", "s")
    monkeypatch.delenv("LLMGW_SERVER")
    clean_env.write_text(f'server = "{bad}"\n')
    with pytest.raises(UsageError, match=r"ctl.toml: server .*expected tcp://HOST:PORT"):
        resolve(None, "k", "s")


def test_several_servers_comma_separated(clean_env: Path) -> None:
    assert resolve("tcp://a:1, tcp://b:2", "k", "s").server == "tcp://a:1, tcp://b:2"

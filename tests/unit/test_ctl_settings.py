from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.ctl.settings import resolve
from llmgw.errors import ConfigError, UsageError


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for var in ("LLMGW_SERVER", "LLMGW_CTL_KEY", "LLMGW_SERVER_KEY", "LLMGW_CTL_CONFIG"):
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


def test_config_flag_then_environment_then_the_default_file(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clean_env.write_text('server = "tcp://default:1"\nkey = "d.key_secret"\nserver_key = "d.key"\n')
    named = tmp_path / "dev" / "ctl.toml"
    named.parent.mkdir()
    named.write_text('server = "tcp://named:1"\nkey = "n.key_secret"\nserver_key = "n.key"\n')
    assert resolve(None, None, None).server == "tcp://default:1"
    assert resolve(None, None, None, config=str(named)).server == "tcp://named:1"
    monkeypatch.setenv("LLMGW_CTL_CONFIG", str(named))
    assert resolve(None, None, None).server == "tcp://named:1"
    assert resolve(None, None, None, config=str(clean_env)).server == "tcp://default:1"
    # A flag or variable still wins over whichever file is read.
    assert resolve("tcp://flag:1", None, None, config=str(named)).server == "tcp://flag:1"


def test_a_named_config_that_is_missing_is_a_usage_error(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(UsageError, match=r"^--config .*nope\.toml: no such file$"):
        resolve("tcp://x:1", "k", "s", config=str(tmp_path / "nope.toml"))
    monkeypatch.setenv("LLMGW_CTL_CONFIG", str(tmp_path / "gone.toml"))
    with pytest.raises(UsageError, match=r"^LLMGW_CTL_CONFIG .*gone\.toml: no such file$"):
        resolve("tcp://x:1", "k", "s")
    # The default file is optional: flags alone are enough without it.
    monkeypatch.delenv("LLMGW_CTL_CONFIG")
    assert resolve("tcp://x:1", "k", "s").key == "k"

"""server.toml's [store] table: PostgreSQL's url, where its password may live, advertise."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zmq.auth

from llmgw.config.load_server import load_server_config
from llmgw.errors import ConfigError


def write(tmp_path: Path, body: str, mode: int = 0o600) -> str:
    keys = tmp_path / "keys"
    (keys / "authorized").mkdir(parents=True, exist_ok=True)
    if not (keys / "server.key_secret").exists():
        zmq.auth.create_certificates(str(keys), "server")
    path = tmp_path / "server.toml"
    path.write_text(f'bind = "tcp://10.0.0.5:7443"\nkeys_dir = "{keys}"\nstate_dir = "{tmp_path}"\n{body}')
    os.chmod(path, mode)
    return str(path)


def test_no_store_table_is_sqlite(tmp_path: Path) -> None:
    cfg = load_server_config(write(tmp_path, ""))
    assert cfg.store.url == "" and cfg.store.lease == 10.0


def test_postgres_with_password_file(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    os.chmod(pw, 0o600)
    cfg = load_server_config(write(tmp_path, (
        f'[store]\nurl = "postgresql://llmgw@db:5432/llmgw"\npassword_file = "{pw}"\nlease = "6s"\n')))
    assert cfg.store.password_file == str(pw) and cfg.store.lease == 6.0


def _error(path: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_server_config(path)
    return str(info.value)


def test_password_in_a_world_readable_config_is_refused(tmp_path: Path) -> None:
    text = '[store]\nurl = "postgresql://llmgw:s3cret@db/llmgw"\n'
    msg = _error(write(tmp_path, text, mode=0o644))
    assert "store.url" in msg and "chmod 600" in msg and "s3cret" not in msg
    load_server_config(write(tmp_path, text, mode=0o600))  # private: accepted


def test_world_readable_password_file_is_refused(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("s3cret")
    os.chmod(pw, 0o644)
    msg = _error(write(tmp_path, f'[store]\nurl = "postgresql://llmgw@db/llmgw"\npassword_file = "{pw}"\n'))
    assert "store.password_file" in msg and "readable by other users" in msg


def test_password_env_must_be_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMGW_TEST_PW", raising=False)
    path = write(tmp_path, '[store]\nurl = "postgresql://llmgw@db/llmgw"\npassword_env = "LLMGW_TEST_PW"\n')
    assert "$LLMGW_TEST_PW is not set" in _error(path)
    monkeypatch.setenv("LLMGW_TEST_PW", "x")
    assert load_server_config(path).store.password_env == "LLMGW_TEST_PW"


@pytest.mark.parametrize(("body", "key"), [
    ('[store]\nurl = "mysql://db/x"\n', "store.url"),
    ('[store]\nurl = "postgresql://db/x"\nlease = "1s"\n', "store.lease"),
    ('[store]\npassword_env = "X"\n', "store.url"),
    ('[store]\nurl = "postgresql://db/x"\nbogus = 1\n', "bogus"),
    ('advertise = "http://x:1"\n[store]\nurl = "postgresql://db/x"\n', "advertise"),
])
def test_bad_store_settings(tmp_path: Path, body: str, key: str) -> None:
    assert key in _error(write(tmp_path, body))


def test_wildcard_bind_needs_advertise(tmp_path: Path) -> None:
    path = write(tmp_path, '[store]\nurl = "postgresql://db/x"\n')
    Path(path).write_text(Path(path).read_text().replace("10.0.0.5", "0.0.0.0"))
    assert "advertise" in _error(path)

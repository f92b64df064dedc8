from __future__ import annotations

from pathlib import Path

import pytest
import zmq.auth

from llmgw.config.load_router import load_router_config
from llmgw.config.load_server import load_server_config
from llmgw.config.router import ModelRouteConfig
from llmgw.errors import ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"
SERVER_TEXT = (CONF / "server.toml").read_text()
ROUTER_TEXT = (CONF / "router.toml").read_text()


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    (d / "authorized").mkdir(parents=True)
    zmq.auth.create_certificates(str(d), "server")
    zmq.auth.create_certificates(str(d), "router-1")
    return d


def write(tmp_path: Path, text: str, keys: Path, name: str, *edits: tuple[str, str]) -> str:
    text = text.replace('"/etc/llmgw/keys', f'"{keys}')
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def server(tmp_path: Path, keys: Path, *edits: tuple[str, str]) -> str:
    return write(tmp_path, SERVER_TEXT, keys, "server.toml", *edits)


def router(tmp_path: Path, keys: Path, *edits: tuple[str, str]) -> str:
    return write(tmp_path, ROUTER_TEXT, keys, "router.toml", *edits)


def expect_error(load: object, path: str, key: str, value: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(path)  # type: ignore[operator]
    text = str(info.value)
    assert path in text, text
    assert info.value.key == key, text
    assert value in text, text
    assert info.value.exit_code == 2
    return text


# ---------------------------------------------------------------- server


def test_shipped_server_config_loads(tmp_path: Path, keys: Path) -> None:
    cfg = load_server_config(server(tmp_path, keys))
    assert cfg.bind == "tcp://0.0.0.0:7443"
    assert cfg.keys_dir == str(keys)
    assert cfg.state_dir == "/var/lib/llmgw-server"
    assert cfg.heartbeat_interval == 5.0
    assert cfg.suspect_after_missed == 3
    assert cfg.lost_after == 60.0
    assert cfg.restart_grace == 120.0
    assert cfg.mass_loss_share == 0.3
    assert cfg.max_message_size == 4 * 1024 * 1024
    assert cfg.source.endswith("server.toml")


def test_server_defaults(tmp_path: Path, keys: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(f'keys_dir = "{keys}"\n')
    cfg = load_server_config(str(path))
    assert cfg.bind == "tcp://0.0.0.0:7443"
    assert cfg.lost_after == 60.0


SERVER_BAD: list[tuple[str, tuple[str, str], str, str]] = [
    ("unknown key", ('state_dir = "', 'colour = "blue"\nstate_dir = "'), "colour", "blue"),
    ("wrong type", ("suspect_after_missed = 3", 'suspect_after_missed = "3"'), "suspect_after_missed", "'3'"),
    (
        "bool for int",
        ("suspect_after_missed = 3", "suspect_after_missed = true"),
        "suspect_after_missed",
        "true",
    ),
    ("suspect zero", ("suspect_after_missed = 3", "suspect_after_missed = 0"), "suspect_after_missed", "0"),
    ("bad duration", ('lost_after = "60s"', 'lost_after = "a minute"'), "lost_after", "a minute"),
    ("duration no unit", ('restart_grace = "2m"', 'restart_grace = "120"'), "restart_grace", "'120'"),
    (
        "negative duration",
        ('heartbeat_interval = "5s"', 'heartbeat_interval = "-5s"'),
        "heartbeat_interval",
        "-5s",
    ),
    ("share zero", ("mass_loss_share = 0.3", "mass_loss_share = 0.0"), "mass_loss_share", "0"),
    ("share above one", ("mass_loss_share = 0.3", "mass_loss_share = 1.5"), "mass_loss_share", "1.5"),
    ("tiny messages", ("max_message_size = 4194304", "max_message_size = 10"), "max_message_size", "10"),
    (
        "http bind",
        ('bind = "tcp://0.0.0.0:7443"', 'bind = "https://0.0.0.0:7443"'),
        "bind",
        "https://0.0.0.0:7443",
    ),
    ("bind no port", ('bind = "tcp://0.0.0.0:7443"', 'bind = "tcp://0.0.0.0"'), "bind", "tcp://0.0.0.0"),
    ("source is internal", ('state_dir = "', 'source = "x"\nstate_dir = "'), "source", "x"),
    ("table for string", ('state_dir = "/var/lib/llmgw-server"', "[state_dir]\na = 1"), "state_dir", "a"),
]


@pytest.mark.parametrize(
    ("edit", "key", "value"), [b[1:] for b in SERVER_BAD], ids=[b[0] for b in SERVER_BAD]
)
def test_bad_server_config(tmp_path: Path, keys: Path, edit: tuple[str, str], key: str, value: str) -> None:
    expect_error(load_server_config, server(tmp_path, keys, edit), key, value)


def test_keys_dir_missing(tmp_path: Path, keys: Path) -> None:
    missing = tmp_path / "nokeys"
    path = server(tmp_path, keys, (f'keys_dir = "{keys}"', f'keys_dir = "{missing}"'))
    text = expect_error(load_server_config, path, "keys_dir", str(missing))
    assert f"llmgw keys init --dir {missing}" in text


def test_keys_dir_without_secret(tmp_path: Path, keys: Path) -> None:
    (keys / "server.key_secret").unlink()
    text = expect_error(load_server_config, server(tmp_path, keys), "keys_dir", str(keys))
    assert "server.key_secret" in text and "llmgw keys init" in text


def test_keys_dir_without_authorized(tmp_path: Path, keys: Path) -> None:
    (keys / "authorized").rmdir()
    text = expect_error(load_server_config, server(tmp_path, keys), "keys_dir", str(keys))
    assert "authorized/" in text


def test_keys_dir_is_a_file(tmp_path: Path, keys: Path) -> None:
    f = keys / "server.key"
    path = server(tmp_path, keys, (f'keys_dir = "{keys}"', f'keys_dir = "{f}"'))
    expect_error(load_server_config, path, "keys_dir", str(f))


def test_server_toml_syntax_error(tmp_path: Path, keys: Path) -> None:
    path = server(tmp_path, keys, ("mass_loss_share = 0.3", "mass_loss_share = "))
    text = expect_error(load_server_config, path, "", "line")
    assert "TOML" in text


def test_server_file_missing(tmp_path: Path) -> None:
    path = str(tmp_path / "none.toml")
    expect_error(load_server_config, path, "", "no such file")


# ---------------------------------------------------------------- router


def test_shipped_router_config_loads(tmp_path: Path, keys: Path) -> None:
    cfg = load_router_config(router(tmp_path, keys))
    assert cfg.bind == "127.0.0.1:8080"
    assert cfg.server == ("tcp://llmgw-server.internal:7443",)
    assert cfg.keys.secret_key == f"{keys}/router-1.key_secret"
    assert cfg.keys.server_key == f"{keys}/server.key"
    assert cfg.api_keys_file == ""
    assert cfg.max_body_bytes == 8 * 1024 * 1024
    assert (cfg.connect_timeout, cfg.first_byte_timeout, cfg.idle_timeout) == (1.0, 300.0, 60.0)
    assert cfg.eject_for == 10.0
    assert cfg.metrics_interval == 0.25
    assert cfg.metrics_stale_after == 2.0
    assert cfg.table_poll_interval == 1.0
    assert cfg.models == {}


def test_router_models(tmp_path: Path, keys: Path) -> None:
    tables = '\n[models."llama-3.1-70b"]\npolicy = "prefix_affinity"\nprefix_chars = 128\n\n[models.small]\n'
    path = router(tmp_path, keys)
    Path(path).write_text(Path(path).read_text() + tables)
    cfg = load_router_config(path)
    assert cfg.models == {
        "llama-3.1-70b": ModelRouteConfig(policy="prefix_affinity", prefix_chars=128),
        "small": ModelRouteConfig(),
    }


def test_router_api_keys_file(tmp_path: Path, keys: Path) -> None:
    f = tmp_path / "api_keys"
    f.write_text("sk-1\n")
    cfg = load_router_config(router(tmp_path, keys, ('api_keys_file = ""', f'api_keys_file = "{f}"')))
    assert cfg.api_keys_file == str(f)


ROUTER_BAD: list[tuple[str, tuple[str, str], str, str]] = [
    ("unknown key", ('bind = "', 'colour = "blue"\nbind = "'), "colour", "blue"),
    (
        "bind with scheme",
        ('bind = "127.0.0.1:8080"', 'bind = "http://127.0.0.1:8080"'),
        "bind",
        "http://127.0.0.1:8080",
    ),
    ("bind without port", ('bind = "127.0.0.1:8080"', 'bind = "127.0.0.1"'), "bind", "127.0.0.1"),
    ("http server", ('server = "tcp://', 'server = "http://'), "server", "http://llmgw"),
    ("bad duration", ('idle_timeout = "60s"', 'idle_timeout = "60"'), "idle_timeout", "'60'"),
    (
        "ms duration",
        ('metrics_interval = "250ms"', 'metrics_interval = "quick"'),
        "metrics_interval",
        "quick",
    ),
    ("body type", ("max_body_bytes = 8388608", 'max_body_bytes = "8MiB"'), "max_body_bytes", "8MiB"),
    (
        "api keys file missing",
        ('api_keys_file = ""', 'api_keys_file = "/no/such/keys"'),
        "api_keys_file",
        "/no/such/keys",
    ),
    (
        "bad policy",
        (
            '# [models."llama-3.1-70b"]\n# policy = "prefix_affinity"',
            '[models."llama-3.1-70b"]\npolicy = "random"',
        ),
        "models.llama-3.1-70b.policy",
        "random",
    ),
    ("unknown model key", ('# [models."llama-3.1-70b"]', "[models.m]\nweight = 2"), "models.m.weight", "2"),
    (
        "prefix chars zero",
        ('# [models."llama-3.1-70b"]', "[models.m]\nprefix_chars = 0"),
        "models.m.prefix_chars",
        "0",
    ),
    ("missing keys", ("[keys]", "[unused]"), "keys", "missing"),
]


@pytest.mark.parametrize(
    ("edit", "key", "value"), [b[1:] for b in ROUTER_BAD], ids=[b[0] for b in ROUTER_BAD]
)
def test_bad_router_config(tmp_path: Path, keys: Path, edit: tuple[str, str], key: str, value: str) -> None:
    expect_error(load_router_config, router(tmp_path, keys, edit), key, value)


def test_router_secret_key_missing(tmp_path: Path, keys: Path) -> None:
    (keys / "router-1.key_secret").unlink()
    text = expect_error(load_router_config, router(tmp_path, keys), "keys.secret_key", "router-1.key_secret")
    assert "llmgw keys issue router" in text


def test_router_secret_key_public_only(tmp_path: Path, keys: Path) -> None:
    path = router(tmp_path, keys, ("router-1.key_secret", "router-1.key"))
    expect_error(load_router_config, path, "keys.secret_key", "router-1.key")

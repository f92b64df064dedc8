"""Load conf/server.toml into ServerConfig, strictly.

Every mistake is one ConfigError naming the file, the key and the bad value.
"""

from __future__ import annotations

import os
from functools import cache

from cattrs import Converter

from llmgw.config.addresses import is_wildcard, parse_tcp
from llmgw.config.checks import check_tcp_address
from llmgw.config.converter import make_converter
from llmgw.config.error_paths import structure_file
from llmgw.config.metrics import check_metrics_bind, check_metrics_token
from llmgw.config.readers import read_toml
from llmgw.config.server import ServerConfig
from llmgw.errors import ConfigError

SERVER_SECRET = "server.key_secret"
AUTHORIZED = "authorized"


@cache
def _converter() -> Converter:
    return make_converter()


def load_server_config(path: str) -> ServerConfig:
    """Read and check a server configuration file. Raises ConfigError."""
    data = read_toml(path)
    cfg = structure_file(_converter(), data, ServerConfig, path=path)
    _check(path, cfg)
    return cfg


def _check(path: str, cfg: ServerConfig) -> None:
    check_tcp_address(path, "bind", cfg.bind, listen=True)
    check_keys_dir(path, "keys_dir", cfg.keys_dir)
    if not cfg.state_dir.strip():
        raise ConfigError(path, "state_dir", f"{cfg.state_dir!r} is empty")
    if cfg.suspect_after_missed < 1:
        raise ConfigError(path, "suspect_after_missed", f"{cfg.suspect_after_missed} must be at least 1")
    if not 0 < cfg.mass_loss_share <= 1:
        raise ConfigError(
            path,
            "mass_loss_share",
            f"{cfg.mass_loss_share:g} must be greater than 0 and at most 1 (a share of nodes)",
        )
    check_store(path, cfg)
    if cfg.max_message_size < 1024:
        raise ConfigError(
            path, "max_message_size", f"{cfg.max_message_size} is too small (at least 1024 bytes)"
        )
    check_metrics_bind(path, "metrics_bind", cfg.metrics_bind)
    check_metrics_token(path, "metrics_bind", cfg.metrics_bind, "metrics_token", cfg.metrics_token)


def check_keys_dir(path: str, key: str, keys_dir: str) -> None:
    """The folder `llmgw keys init` made: server.key_secret and authorized/."""
    hint = f"make it with `llmgw keys init --dir {keys_dir or 'DIR'}`"
    if not keys_dir:
        raise ConfigError(path, key, f"is empty; {hint}")
    if not os.path.isdir(keys_dir):
        what = "is not a directory" if os.path.exists(keys_dir) else "does not exist"
        raise ConfigError(path, key, f"{keys_dir!r} {what}; {hint}")
    secret = os.path.join(keys_dir, SERVER_SECRET)
    if not os.path.isfile(secret):
        raise ConfigError(path, key, f"{keys_dir!r} has no {SERVER_SECRET}; {hint}")
    try:
        with open(secret, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(
            path, key, f"{keys_dir!r}: cannot read {SERVER_SECRET}: {exc.strerror or exc}"
        ) from None
    if not os.path.isdir(os.path.join(keys_dir, AUTHORIZED)):
        raise ConfigError(path, key, f"{keys_dir!r} has no {AUTHORIZED}/ folder; {hint}")


def check_store(path: str, cfg: ServerConfig) -> None:
    """PostgreSQL settings: a postgresql:// url, and a password never only in a file that
    others can read."""
    st = cfg.store
    if not st.url:
        if st.password_file or st.password_env:
            raise ConfigError(path, "store.url", "is empty, but a password is given: set the "
                              "postgresql:// url, or drop the password for SQLite")
        return
    if not st.url.startswith(("postgresql://", "postgres://")):
        # Not echoed: it may hold a password.
        raise ConfigError(path, "store.url", "does not start with postgresql://")
    if st.lease < 2.0:
        raise ConfigError(path, "store.lease", f"{st.lease:g}s is too short (at least 2s)")
    if st.password_file and st.password_env:
        raise ConfigError(path, "store.password_file", "give password_file or password_env, not both")
    if _url_has_password(st.url) and _readable_by_others(path):
        raise ConfigError(path, "store.url", "holds a password, and this file is readable by other "
                          f"users; chmod 600 {path}, or move the password to store.password_file")
    if st.password_file:
        if not os.path.isfile(st.password_file):
            raise ConfigError(path, "store.password_file", f"{st.password_file!r} does not exist")
        if _readable_by_others(st.password_file):
            raise ConfigError(path, "store.password_file",
                              f"{st.password_file!r} is readable by other users; chmod 600 it")
    if st.password_env and not os.environ.get(st.password_env):
        raise ConfigError(path, "store.password_env", f"${st.password_env} is not set")
    if not cfg.advertise and is_wildcard(parse_tcp(cfg.bind, listen=True)[0]):
        raise ConfigError(path, "advertise", f"is needed with PostgreSQL when bind is {cfg.bind!r}: "
                          "the address agents reach this server at (standbys name the leader by it)")
    if cfg.advertise:
        check_tcp_address(path, "advertise", cfg.advertise)


def _url_has_password(url: str) -> bool:
    creds = url.split("//", 1)[-1].split("@", 1)
    return len(creds) == 2 and ":" in creds[0] or "password=" in url


def _readable_by_others(path: str) -> bool:
    try:
        return bool(os.stat(path).st_mode & 0o004)
    except OSError:
        return False

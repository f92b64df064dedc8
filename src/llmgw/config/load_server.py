"""Load conf/server.toml into ServerConfig, strictly.

Every mistake is one ConfigError naming the file, the key and the bad value.
"""

from __future__ import annotations

import os
from functools import cache

from cattrs import Converter

from llmgw.config._strict import (
    check_tcp_address,
    make_converter,
    read_toml,
    structure_file,
)
from llmgw.config.metrics import check_metrics_bind, check_metrics_token
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
    check_tcp_address(path, "bind", cfg.bind)
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

"""Where ctl finds the server and its keys: flags, then environment, then
~/.config/llmgw/ctl.toml."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from attrs import frozen

from llmgw.errors import ConfigError, UsageError

ENV = {"server": "LLMGW_SERVER", "key": "LLMGW_CTL_KEY", "server_key": "LLMGW_SERVER_KEY"}


@frozen
class CtlSettings:
    server: str
    key: str
    server_key: str


def default_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "llmgw" / "ctl.toml"


def _file_values(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), "", f"cannot read: {exc}") from None
    out: dict[str, str] = {}
    for k, v in data.items():
        if k not in ENV:
            raise ConfigError(str(path), k, f"unknown key (known: {', '.join(ENV)})")
        if not isinstance(v, str):
            raise ConfigError(str(path), k, f"expected a string, got {v!r}")
        out[k] = v
    return out


def resolve(
    server: str | None, key: str | None, server_key: str | None, file: Path | None = None
) -> CtlSettings:
    flags = {"server": server, "key": key, "server_key": server_key}
    from_file = _file_values(file or default_file())
    chosen: dict[str, str] = {}
    for name, env in ENV.items():
        value = flags[name] or os.environ.get(env) or from_file.get(name)
        if not value:
            flag = "--" + name.replace("_", "-")
            raise UsageError(
                f"no {name.replace('_', ' ')}: give {flag}, set {env}, or put {name} in {default_file()}"
            )
        chosen[name] = value
    return CtlSettings(**chosen)

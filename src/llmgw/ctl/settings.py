"""Where ctl finds the server and its keys: flags, then environment, then a ctl.toml:
the one --config or LLMGW_CTL_CONFIG names (which must exist), else
~/.config/llmgw/ctl.toml (if it exists)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from attrs import frozen

from llmgw.errors import ConfigError, UsageError

ENV = {"server": "LLMGW_SERVER", "key": "LLMGW_CTL_KEY", "server_key": "LLMGW_SERVER_KEY"}
CONFIG_ENV = "LLMGW_CTL_CONFIG"


@frozen
class CtlSettings:
    server: str
    key: str
    server_key: str


def default_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "llmgw" / "ctl.toml"


def settings_file(config: str | None) -> tuple[Path, str]:
    """The ctl.toml to read and who named it ("" for the default, which may be absent)."""
    if config:
        return Path(config), "--config"
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV]), CONFIG_ENV
    return default_file(), ""


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


def servers_of(settings: CtlSettings) -> list[str]:
    return [s.strip() for s in settings.server.split(",") if s.strip()]


def resolve(
    server: str | None,
    key: str | None,
    server_key: str | None,
    file: Path | None = None,
    *,
    config: str | None = None,
) -> CtlSettings:
    """Each setting from the first of: its flag, its environment variable, the file
    (`file`, else settings_file(config)). Server addresses are checked here, naming where
    the bad one came from."""
    path, named_by = (file, "") if file else settings_file(config)
    if named_by and not path.is_file():
        # Named on purpose, so its absence is a mistake (the default file is optional).
        raise UsageError(f"{named_by} {path}: no such file")
    flags = {"server": server, "key": key, "server_key": server_key}
    from_file = _file_values(path)
    chosen: dict[str, str] = {}
    for name, env in ENV.items():
        flag = "--" + name.replace("_", "-")
        found = [(v, where) for v, where in ((flags[name], flag), (os.environ.get(env), env),
                                             (from_file.get(name), f"{path}: {name}")) if v]
        if not found:
            raise UsageError(
                f"no {name.replace('_', ' ')}: give {flag}, set {env}, or put {name} in {path}"
            )
        value, where = found[0]
        if name == "server":
            _check_servers(value, where)
        chosen[name] = value
    return CtlSettings(**chosen)


def _check_servers(value: str, where: str) -> None:
    from llmgw.transport.client import check_address

    addresses = [s.strip() for s in value.split(",") if s.strip()]
    if not addresses:
        raise UsageError(f"{where} {value!r}: no server address in it")
    for a in addresses:
        wrong = check_address(a)
        if wrong is not None:
            raise UsageError(f"{where} {a!r}: {wrong}")

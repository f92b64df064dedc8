"""Config files read strictly: YAML without duplicate keys, TOML, UTF-8 only, a mapping at
the top; each mistake one ConfigError naming the file."""

from __future__ import annotations

import tomllib
from typing import Any

import yaml

from llmgw.config.error_paths import describe
from llmgw.errors import ConfigError


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} written twice", key_node.start_mark
            )
        seen[key] = loader.construct_object(value_node, deep=True)
    return seen


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ConfigError(path, "", "no such file") from None
    except IsADirectoryError:
        raise ConfigError(path, "", "is a directory, not a config file") from None
    except OSError as exc:
        raise ConfigError(path, "", f"cannot read: {exc.strerror or exc}") from None


def _top_mapping(path: str, data: object) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(path, "", f"the top level must be a mapping of keys, got {describe(data)}")
    for k in data:
        if not isinstance(k, str):
            raise ConfigError(path, str(k), f"keys must be strings, got {describe(k)}")
    return data


def read_yaml(path: str) -> dict[str, Any]:
    raw = _read_bytes(path)
    try:
        data = yaml.load(raw, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = "; ".join(str(s) for s in (exc.context, exc.problem) if s)
        raise ConfigError(path, "", f"YAML error at {where}{what}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(path, "", f"YAML syntax error: {exc}") from None
    return _top_mapping(path, data)


def read_toml(path: str) -> dict[str, Any]:
    raw = _read_bytes(path)
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(path, "", f"not UTF-8 text: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, "", f"TOML syntax error: {exc}") from None
    return _top_mapping(path, data)

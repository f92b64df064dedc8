"""Shared machinery for strict config loading.

A cattrs converter that forbids unknown keys, never coerces types ("12" is not an int,
12 is not a string) and reads durations; and the translation of its errors into one
ConfigError naming the file, the key path (`fabrics[1].hcas`) and the bad value.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, get_args, get_origin

import attrs
import yaml
import zmq.auth
from cattrs import Converter
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn
from zmq.utils import z85

from llmgw.config.addresses import AddressError, parse_host_port, parse_tcp
from llmgw.config.duration import Duration, duration_from_value
from llmgw.errors import ConfigError

T = TypeVar("T")
PathPart = str | int

_MISSING = object()


def describe(value: object) -> str:
    """A value as an operator would recognise it in the file."""
    if value is None:
        return "null (an empty value)"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return f"a mapping {dict(value)!r}"
    if isinstance(value, list | tuple):
        return f"a list {list(value)!r}"
    return repr(value)


def format_path(parts: list[PathPart]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def lookup(data: object, parts: list[PathPart]) -> object:
    """The raw value at a key path, or _MISSING."""
    cur = data
    for part in parts:
        if isinstance(part, int) and isinstance(cur, list | tuple) and 0 <= part < len(cur):
            cur = cur[part]
        elif isinstance(part, str) and isinstance(cur, Mapping) and part in cur:
            cur = cur[part]
        else:
            return _MISSING
    return cur


# ---------------------------------------------------------------- converter


def _expect(kind: str, value: object) -> ValueError:
    return ValueError(f"expected {kind}, got {describe(value)}")


def _structure_str(value: object, _: type) -> str:
    if not isinstance(value, str):
        hint = " (quote it)" if isinstance(value, int | float | bool) else ""
        raise ValueError(f"expected a string, got {describe(value)}{hint}")
    return value


def _structure_int(value: object, _: type) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _expect("a whole number", value)
    return value


def _structure_float(value: object, _: type) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _expect("a number", value)
    return float(value)


def _structure_bool(value: object, _: type) -> bool:
    if not isinstance(value, bool):
        raise _expect("true or false", value)
    return value


def _structure_duration(value: object, _: type) -> float:
    seconds = duration_from_value(value)
    if seconds <= 0:
        raise ValueError(f"duration {describe(value)} must be greater than zero")
    return seconds


def _is_tuple(t: Any) -> bool:
    return get_origin(t) is tuple


def _is_dict(t: Any) -> bool:
    return get_origin(t) is dict


def _tuple_factory(t: Any, conv: Converter) -> Callable[[object, Any], tuple[Any, ...]]:
    args = get_args(t)
    variadic = len(args) == 2 and args[1] is Ellipsis
    elem_types = [args[0]] if variadic else list(args)
    hooks = [conv.get_structure_hook(e) for e in elem_types]

    def hook(value: object, _: Any) -> tuple[Any, ...]:
        if value is None and variadic:
            return ()
        if not isinstance(value, list | tuple):
            raise _expect("a list", value)
        if not variadic and len(value) != len(elem_types):
            raise _expect(f"a list of {len(elem_types)} items", value)
        out: list[Any] = []
        errors: list[Exception] = []
        for i, item in enumerate(value):
            et, h = (elem_types[0], hooks[0]) if variadic else (elem_types[i], hooks[i])
            try:
                out.append(h(item, et))
            except Exception as exc:  # collected and reported with its path below
                exc.add_note(IterableValidationNote(f"Structuring {t} @ index {i}", i, et))
                errors.append(exc)
        if errors:
            raise IterableValidationError(f"While structuring {t!r}", errors, t)
        return tuple(out)

    return hook


def _dict_factory(t: Any, conv: Converter) -> Callable[[object, Any], dict[Any, Any]]:
    kt, vt = get_args(t)
    khook, vhook = conv.get_structure_hook(kt), conv.get_structure_hook(vt)

    def hook(value: object, _: Any) -> dict[Any, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise _expect("a mapping (key: value)", value)
        out: dict[Any, Any] = {}
        errors: list[Exception] = []
        for k, v in value.items():
            try:
                out[khook(k, kt)] = vhook(v, vt)
            except Exception as exc:  # collected and reported with its path below
                exc.add_note(AttributeValidationNote(f"Structuring {t} @ key {k!r}", str(k), vt))
                errors.append(exc)
        if errors:
            raise ClassValidationError(f"While structuring {t!r}", errors, dict)
        return out

    return hook


def _attrs_factory(cl: type, conv: Converter) -> Callable[[object, Any], Any]:
    inner: Callable[[Mapping[str, Any], Any], Any] = make_dict_structure_fn(
        cl, conv, _cattrs_forbid_extra_keys=True, _cattrs_detailed_validation=True
    )

    def hook(value: object, t: Any) -> Any:
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise _expect("a mapping (key: value)", value)
        return inner(value, t)

    return hook


def make_converter() -> Converter:
    """A converter for config files: strict types, unknown keys forbidden, durations read."""
    conv = Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook(str, _structure_str)
    conv.register_structure_hook(int, _structure_int)
    conv.register_structure_hook(float, _structure_float)
    conv.register_structure_hook(bool, _structure_bool)
    conv.register_structure_hook_func(lambda t: t is Duration, _structure_duration)
    conv.register_structure_hook_factory(_is_tuple, _tuple_factory)
    conv.register_structure_hook_factory(_is_dict, _dict_factory)
    conv.register_structure_hook_factory(attrs.has, _attrs_factory)
    return conv


# ---------------------------------------------------------------- errors


def _note_part(exc: BaseException) -> PathPart | None:
    for note in getattr(exc, "__notes__", ()):
        if isinstance(note, AttributeValidationNote):
            return note.name
        if isinstance(note, IterableValidationNote):
            idx = note.index
            return idx if isinstance(idx, int) else str(idx)
    return None


def _leaves(exc: BaseException, path: list[PathPart]) -> list[tuple[list[PathPart], BaseException]]:
    if isinstance(exc, ForbiddenExtraKeysError):
        return [(path + [k], exc) for k in sorted(exc.extra_fields)]
    if isinstance(exc, BaseExceptionGroup):
        out: list[tuple[list[PathPart], BaseException]] = []
        for sub in exc.exceptions:
            part = _note_part(sub)
            out.extend(_leaves(sub, path + ([part] if part is not None else [])))
        return out
    return [(path, exc)]


def _leaf_message(exc: BaseException, cl: type | None, value: object) -> str:
    if isinstance(exc, ForbiddenExtraKeysError):
        known = ", ".join(a.name for a in attrs.fields(exc.cl)) if attrs.has(exc.cl) else ""
        hint = f" (known keys here: {known})" if known else ""
        return f"unknown key, with value {describe(value)}{hint}"
    if isinstance(exc, KeyError):
        return "is required but missing"
    if isinstance(exc, ValueError):
        return str(exc)
    return f"invalid value {describe(value)}: {exc}"


def structure(conv: Converter, data: Mapping[str, Any], cl: type[T], *, source: str) -> T:
    """Structure `data` into `cl`, turning any failure into one ConfigError."""
    try:
        return conv.structure(data, cl)
    except Exception as exc:
        leaves = _leaves(exc, [])
        path, leaf = leaves[0]
        value = lookup(data, path)
        msg = _leaf_message(leaf, cl, value)
        if len(leaves) > 1:
            others = ", ".join(format_path(p) or "(top level)" for p, _ in leaves[1:4])
            more = "…" if len(leaves) > 4 else ""
            msg += f" (also wrong: {others}{more})"
        raise ConfigError(source, format_path(path), msg) from None


def structure_file(conv: Converter, data: Mapping[str, Any], cl: type[T], *, path: str) -> T:
    """`data`, read from `path`, into `cl` with its `source` set to `path`. `source` is
    ours to set: a file that names it has an unknown key."""
    if "source" in data:
        raise ConfigError(path, "source", f"unknown key, with value {describe(data['source'])}")
    return attrs.evolve(structure(conv, data, cl, source=path), source=path)  # type: ignore[misc]


# ---------------------------------------------------------------- reading files


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


# ---------------------------------------------------------------- common checks

def check_tcp_address(source: str, key: str, value: str, *, listen: bool = False) -> None:
    """`tcp://host:port` (config/addresses.py's grammar, the dialler's); `listen`: a bind,
    which may name every interface (`*`)."""
    try:
        parse_tcp(value, listen=listen)
    except AddressError as exc:
        raise ConfigError(source, key, f"{value!r}: {exc}") from None


def check_host_port(source: str, key: str, value: str) -> None:
    """`host:port` with no scheme: an HTTP listener's address."""
    try:
        parse_host_port(value)
    except AddressError as exc:
        raise ConfigError(source, key, f"{value!r}: {exc}") from None


def check_readable_file(source: str, key: str, value: str, hint: str = "") -> None:
    """The file exists, is a regular file and can be read."""
    tail = f"; {hint}" if hint else ""
    if not value:
        raise ConfigError(source, key, f"is empty; give the path of a file{tail}")
    if not os.path.exists(value):
        raise ConfigError(source, key, f"no such file {value!r}{tail}")
    if os.path.isdir(value):
        raise ConfigError(source, key, f"{value!r} is a directory, not a file{tail}")
    try:
        with open(value, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(source, key, f"cannot read {value!r}: {exc.strerror or exc}") from None


def check_key_file(source: str, key: str, value: str, *, secret: bool, hint: str = "") -> None:
    """A zmq certificate file; with `secret`, one that holds a secret key too."""
    check_readable_file(source, key, value, hint)
    try:
        public, secret_key = zmq.auth.load_certificate(value)
    except (OSError, ValueError) as exc:
        raise ConfigError(source, key, f"{value!r} is not a zmq certificate file ({exc})") from None
    for name, k in (("public", public), ("secret", secret_key)):
        if k is not None and not _valid_z85_key(k):
            raise ConfigError(source, key, f"{value!r} holds a malformed {name} key")
    if secret and secret_key is None:
        raise ConfigError(
            source,
            key,
            f"{value!r} holds only a public key; point this at the secret key file "
            "(the one ending in .key_secret)",
        )


def _valid_z85_key(k: bytes) -> bool:
    if len(k) != 40:
        return False
    try:
        z85.decode(k)
    except (ValueError, KeyError, TypeError, IndexError):
        return False
    return True

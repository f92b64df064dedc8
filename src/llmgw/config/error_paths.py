"""Where a config mistake is and what it holds: key paths (`fabrics[1].hcas`), the raw value
at one, and a value as an operator would recognise it in the file; and the translation of a
strict converter's errors into one ConfigError naming the file, the key path and the value."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import attrs
from cattrs import Converter
from cattrs.errors import AttributeValidationNote, ForbiddenExtraKeysError, IterableValidationNote

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

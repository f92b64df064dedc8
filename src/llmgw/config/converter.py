"""The strict cattrs converter every config file is read with: unknown keys forbidden, no
type coerced ("12" is not an int, 12 is not a string), durations read."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, get_args, get_origin

import attrs
from cattrs import Converter
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn

from llmgw.config.duration import Duration, duration_from_value
from llmgw.config.error_paths import describe


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

"""The server addresses an agent, a router or ctl follows: one, as before, or a list (several
servers on PostgreSQL; whichever leads answers, the others name it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from cattrs import Converter


class _AddressesMarker:
    """Marks a tuple of server addresses for the config converter."""


# `server = "tcp://a:7443"` or `server = ["tcp://a:7443", "tcp://b:7443"]` in a file.
Addresses = Annotated[tuple[str, ...], _AddressesMarker]


def to_addresses(value: str | Sequence[str]) -> tuple[str, ...]:
    """attrs converter: code may pass one address or several."""
    return (value,) if isinstance(value, str) else tuple(value)


def _structure(value: object, _: type) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not value:
        raise ValueError("expected a server address (tcp://host:port) or a non-empty list of them")
    bad = [v for v in value if not isinstance(v, str)]
    if bad:
        raise ValueError(f"expected addresses (strings), got a {type(bad[0]).__name__}")
    if len(set(value)) != len(value):
        raise ValueError("lists the same address twice")
    return tuple(value)


def register(conv: Converter) -> Converter:
    conv.register_structure_hook_func(lambda t: t is Addresses, _structure)
    return conv

"""Addresses, one grammar for all of llmgw (pure): `tcp://HOST:PORT` for ZeroMQ (the server's
bind and advertise, the server addresses agents, routers and ctl dial) and `HOST:PORT` for
HTTP listeners (the router's bind, metrics_bind). Every config loader, ctl and the dialler
check with these functions, so an address a config check accepts is one the dialler dials.

HOST is an IPv4 address, an IPv6 address in brackets, or a DNS name (labels of letters,
digits, '-' and '_', dots between); a listener names every interface with `0.0.0.0` or
`[::]`, a ZeroMQ one with `*` too (ZeroMQ's own spelling; an HTTP listener refuses it, as
the socket calls would). PORT is 1..65535.

Also here: the server addresses an agent, a router or ctl follows: one, as before, or a
list (several servers on PostgreSQL; whichever leads answers, the others name it)."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from typing import Annotated

from cattrs import Converter

TCP_FORM = "tcp://HOST:PORT, e.g. tcp://127.0.0.1:7443"
HOST_PORT_FORM = "HOST:PORT, e.g. 127.0.0.1:8080"
WILDCARDS = ("*", "0.0.0.0", "::")
_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")


class AddressError(ValueError):
    """What is wrong with an address, in words (callers add where it came from)."""


def parse_host(host: str, *, star: bool = False) -> str:
    """`host` checked: the host without brackets. `star`: ZeroMQ's `*` is allowed too."""
    if host.startswith("[") and host.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            raise AddressError(f"{host} is not an IPv6 address") from None
    if star and host == "*":
        return host
    if host.replace(".", "").isdigit():
        try:
            return str(ipaddress.IPv4Address(host))
        except ValueError:
            raise AddressError(f"{host} is not an IPv4 address") from None
    if ":" in host:
        raise AddressError(f"{host}: an IPv6 address goes in brackets, e.g. [::1]")
    if not host or len(host) > 253 or not all(_LABEL.match(label) for label in host.split(".")):
        raise AddressError(f"{host!r} is not a host name (letters, digits, '-', '_' and dots)")
    return host


def parse_host_port(value: str, *, star: bool = False, any_port: bool = False) -> tuple[str, int]:
    """`HOST:PORT` -> (host without brackets, port). `any_port`: port 0 too, for a listener
    made in code (tests, `llmgw dev`) that lets the kernel pick; config files never may."""
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise AddressError(f"expected {HOST_PORT_FORM}")
    if not port.isascii() or not port.isdigit() or len(port) > 5:
        raise AddressError(f"port {port!r} is not a number")
    if not (0 if any_port else 1) <= int(port) <= 65535:
        raise AddressError(f"port {int(port)} is outside 1..65535")
    return parse_host(host, star=star), int(port)


def parse_tcp(value: str, *, listen: bool = False) -> tuple[str, int]:
    """`tcp://HOST:PORT` -> (host, port); an http(s) address is refused with the reason.
    `listen`: a bind, which may name every interface as `*`."""
    if value.startswith(("http://", "https://")):
        raise AddressError(
            f"expected {TCP_FORM}; this is an HTTP address, and llmgw speaks ZeroMQ with "
            "CURVE (which replaces TLS), not HTTP")
    if not value.startswith("tcp://"):
        raise AddressError(f"expected {TCP_FORM}")
    try:
        return parse_host_port(value[len("tcp://"):], star=listen)
    except AddressError as exc:
        raise AddressError(f"{exc}; expected {TCP_FORM}") from None


def is_wildcard(host: str) -> bool:
    """A listener's host that names every interface (as parse_host returns it)."""
    return host in WILDCARDS


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

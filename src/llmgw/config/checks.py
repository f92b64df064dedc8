"""Checks of single config values that need more than a type: addresses (config/addresses.py's
one grammar), readable files, CURVE key files."""

from __future__ import annotations

import os

import zmq.auth
from zmq.utils import z85

from llmgw.config.addresses import AddressError, parse_host_port, parse_tcp
from llmgw.errors import ConfigError


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

"""Checks of the `metrics_bind` and `metrics_token` keys (server and agent). Pure."""

from __future__ import annotations

import ipaddress

from llmgw.config.addresses import parse_host_port
from llmgw.config.checks import check_host_port
from llmgw.errors import ConfigError

MIN_TOKEN = 16  # characters: a token is a password that travels with every scrape


def split_host_port(value: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host without brackets, port). The value was checked
    (a listener made in code may ask for port 0: the kernel picks)."""
    return parse_host_port(value, any_port=True)


def is_loopback(host: str) -> bool:
    """Only what cannot be reached from another machine: 127.0.0.0/8, ::1, `localhost`.
    Any other name may resolve to anything, so it does not count."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_metrics_bind(source: str, key: str, value: str) -> None:
    """Empty (no listener) or host:port."""
    if value:
        check_host_port(source, key, value)


def check_metrics_token(source: str, bind_key: str, bind: str, token_key: str, token: str) -> None:
    """A token, when set, is long and header-safe; a non-loopback bind must have one: the
    status page shows the whole cluster."""
    if token and (len(token) < MIN_TOKEN or not all("!" <= c <= "~" for c in token)):
        raise ConfigError(
            source, token_key,
            f"must be at least {MIN_TOKEN} printable ASCII characters without spaces "
            "(e.g. the output of `openssl rand -hex 24`)",
        )
    if bind and not token and not is_loopback(split_host_port(bind)[0]):
        raise ConfigError(
            source, bind_key,
            f"{bind!r} is reachable from other machines; set {token_key} as well (requests "
            "then need `Authorization: Bearer TOKEN`), or bind 127.0.0.1",
        )

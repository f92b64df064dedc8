"""Load conf/router.toml into RouterConfig, strictly."""

from __future__ import annotations

import math
from functools import cache

from cattrs import Converter

from llmgw.config import addresses
from llmgw.config.checks import check_host_port, check_key_file, check_readable_file, check_tcp_address
from llmgw.config.converter import make_converter
from llmgw.config.error_paths import structure_file
from llmgw.config.readers import read_toml
from llmgw.config.router import (
    MAX_KV_INDEX_BLOCKS,
    MAX_KV_SPECULATIVE_TTL,
    POLICIES,
    ModelRouteConfig,
    RouterConfig,
)
from llmgw.errors import ConfigError
from llmgw.model.apikey import check_class

# Continuations of one stream at most: each re-reads the whole prompt and what was sent.
MAX_MIGRATIONS = 10


@cache
def _converter() -> Converter:
    return addresses.register(make_converter())


def load_router_config(path: str) -> RouterConfig:
    """Read and check a router configuration file. Raises ConfigError."""
    data = read_toml(path)
    cfg = structure_file(_converter(), data, RouterConfig, path=path)
    _check(path, cfg)
    return cfg


def _check(path: str, cfg: RouterConfig) -> None:
    check_host_port(path, "bind", cfg.bind)
    for address in cfg.server:
        check_tcp_address(path, "server", address)
    if cfg.max_body_bytes < 1:
        raise ConfigError(path, "max_body_bytes", f"{cfg.max_body_bytes} must be at least 1")
    if cfg.header_timeout <= 0:
        raise ConfigError(path, "header_timeout", f"{cfg.header_timeout:g}s must be more than 0")
    for key in ("eject_after", "max_requests_per_replica", "max_connecting_per_replica"):
        if getattr(cfg, key) < 1:
            raise ConfigError(path, key, f"{getattr(cfg, key)} must be at least 1")
    if cfg.queue_size < 0:
        raise ConfigError(path, "queue_size", f"{cfg.queue_size} must be 0 (no queue) or more")
    if cfg.queue_wait < 0:
        raise ConfigError(path, "queue_wait", f"{cfg.queue_wait:g}s must not be negative")
    _check_classes(path, cfg)
    if cfg.failover_timeout <= 0:
        raise ConfigError(path, "failover_timeout", f"{cfg.failover_timeout:g}s must be more than 0")
    if cfg.load_report_interval < 0.1:
        raise ConfigError(path, "load_report_interval",
                          f"{cfg.load_report_interval:g}s must be at least 100ms")
    if cfg.key_table_interval < 0.1:
        raise ConfigError(path, "key_table_interval",
                          f"{cfg.key_table_interval:g}s must be at least 100ms")
    if cfg.usage_report_interval < 0.1:
        raise ConfigError(path, "usage_report_interval",
                          f"{cfg.usage_report_interval:g}s must be at least 100ms")
    if cfg.hold_queue < 0:
        raise ConfigError(path, "hold_queue", f"{cfg.hold_queue} must be 0 (refuse at once) or more")
    if cfg.cold_start_budget <= 0:
        raise ConfigError(path, "cold_start_budget", f"{cfg.cold_start_budget:g}s must be more than 0")
    for name, route in cfg.models.items():
        if route.policy not in POLICIES:
            raise ConfigError(
                path,
                f"models.{name}.policy",
                f"{route.policy!r} is not one of " + ", ".join(f'"{p}"' for p in POLICIES),
            )
        if not 0 <= route.failover_migrations <= MAX_MIGRATIONS:
            raise ConfigError(path, f"models.{name}.failover_migrations",
                              f"{route.failover_migrations} must be from 0 (off) to {MAX_MIGRATIONS}")
        if route.prefix_chars < 1:
            raise ConfigError(path, f"models.{name}.prefix_chars", f"{route.prefix_chars} must be at least 1")
        _check_kv(path, f"models.{name}", route)
    if cfg.api_keys_file:
        check_readable_file(path, "api_keys_file", cfg.api_keys_file)
    check_key_file(
        path,
        "keys.secret_key",
        cfg.keys.secret_key,
        secret=True,
        hint="make it with `llmgw keys issue router NAME --dir DIR` on the server",
    )
    check_key_file(
        path,
        "keys.server_key",
        cfg.keys.server_key,
        secret=False,
        hint="copy server.key from the folder `llmgw keys init` made on the server",
    )


def _check_classes(path: str, cfg: RouterConfig) -> None:
    seen: set[str] = set()
    for i, c in enumerate(cfg.classes):
        why = check_class(c.name)
        if why:
            raise ConfigError(path, f"classes[{i}].name", why)
        if c.name in seen:
            raise ConfigError(path, f"classes[{i}].name", f"{c.name!r} is listed twice")
        seen.add(c.name)
        if c.ttl <= 0:
            raise ConfigError(path, f"classes[{i}].ttl", f"{c.ttl:g}s must be more than 0")
    if cfg.default_class and cfg.default_class not in seen:
        names = ", ".join(repr(c.name) for c in cfg.classes) or "none"
        raise ConfigError(path, "default_class",
                          f"{cfg.default_class!r} is not one of the classes listed ({names})")


def _check_kv(path: str, at: str, route: ModelRouteConfig) -> None:
    """kv_aware's keys. The tokenizer folder itself is read when the router starts: one
    it cannot read makes the model prefix_affinity there (with a log line and a metric),
    so that a router whose model folder is away still serves."""
    if route.policy == "kv_aware" and not route.tokenizer:
        raise ConfigError(path, f"{at}.tokenizer",
                          "policy kv_aware needs the model's tokenizer folder (its tokenizer.json)")
    if route.policy != "kv_aware" and route.tokenizer:
        raise ConfigError(path, f"{at}.tokenizer", f"is read only with policy kv_aware, not {route.policy!r}")
    if not math.isfinite(route.kv_weight) or route.kv_weight < 0:
        raise ConfigError(path, f"{at}.kv_weight", f"{route.kv_weight} must be a number, 0 or more")
    if not 0 <= route.kv_speculative_ttl <= MAX_KV_SPECULATIVE_TTL:
        raise ConfigError(path, f"{at}.kv_speculative_ttl",
                          f"{route.kv_speculative_ttl:g}s must be from 0 (none) "
                          f"to {MAX_KV_SPECULATIVE_TTL:g}s")
    if not 1 <= route.kv_index_blocks <= MAX_KV_INDEX_BLOCKS:
        raise ConfigError(path, f"{at}.kv_index_blocks",
                          f"{route.kv_index_blocks} must be from 1 to {MAX_KV_INDEX_BLOCKS}")

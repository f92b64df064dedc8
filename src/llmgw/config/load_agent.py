"""Load conf/agent.yaml into AgentConfig, strictly.

Every mistake is one ConfigError naming the file, the key path and the bad value.
Paths in the file are kept as written (never resolved): they are checked from the
agent's working directory, which is where they will be opened.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from functools import cache
from typing import Any

from attrs import evolve
from cattrs import Converter
from cattrs.gen import make_dict_structure_fn

from llmgw.config import addresses
from llmgw.config.agent import AgentConfig, ModelDirConfig
from llmgw.config.checks import check_key_file, check_tcp_address
from llmgw.config.converter import make_converter
from llmgw.config.error_paths import describe, structure_file
from llmgw.config.metrics import check_metrics_bind
from llmgw.config.readers import read_yaml
from llmgw.errors import ConfigError

LAUNCH_MODES = ("ray", "mp")


@cache
def _converter() -> Converter:
    conv = addresses.register(make_converter())
    inner = make_dict_structure_fn(
        ModelDirConfig, conv, _cattrs_forbid_extra_keys=True, _cattrs_detailed_validation=True
    )

    def model_dir(value: object, t: Any) -> ModelDirConfig:
        if isinstance(value, str):
            value = {"path": value}
        if not isinstance(value, Mapping):
            raise ValueError(
                f"expected a directory path or a mapping {{path, shared, store}}, got {describe(value)}"
            )
        return inner(value, t)

    conv.register_structure_hook(ModelDirConfig, model_dir)
    return conv


def load_agent_config(path: str) -> AgentConfig:
    """Read and check an agent configuration file. Raises ConfigError."""
    data = read_yaml(path)
    if "model_dirs" in data and data["model_dirs"] in (None, [], ()):
        raise ConfigError(
            path,
            "model_dirs",
            f"is empty ({describe(data['model_dirs'])}); list at least one directory, or "
            "remove the key so that this node is not asked to look",
        )
    if "node_id" not in data:
        data = {**data, "node_id": socket.gethostname()}
    cfg = structure_file(_converter(), data, AgentConfig, path=path)
    _check(path, cfg)
    if cfg.download_dir is None:
        cfg = evolve(cfg, download_dir=default_download_dir(cfg))
    return cfg


def default_download_dir(cfg: AgentConfig) -> str:
    """The first model_dirs entry this process may write to ("" when none is, or there
    are no model_dirs): a read-only filer of weights is common, and a download there would
    only fail."""
    for md in cfg.model_dirs or ():
        if os.access(md.path, os.W_OK):
            return md.path
    return ""


def _check(path: str, cfg: AgentConfig) -> None:
    if not cfg.node_id.strip():
        raise ConfigError(path, "node_id", f"{cfg.node_id!r} is empty; remove the key to use the hostname")
    for address in cfg.server:
        check_tcp_address(path, "server", address)
    check_metrics_bind(path, "metrics_bind", cfg.metrics_bind)
    if not cfg.mgmt_addr.strip():
        raise ConfigError(
            path, "mgmt_addr", f"{cfg.mgmt_addr!r} is empty; give the address engines are reachable on"
        )
    if cfg.reconnect_base > cfg.reconnect_max:
        raise ConfigError(
            path,
            "reconnect_max",
            f"{cfg.reconnect_max:g}s is shorter than reconnect_base ({cfg.reconnect_base:g}s)",
        )
    _check_fabrics(path, cfg)
    _check_model_dirs(path, cfg)
    if cfg.download_dir is not None and cfg.download_dir and not cfg.download_dir.strip():
        raise ConfigError(path, "download_dir", f"{cfg.download_dir!r} is blank; name a folder, "
                          'or "" for the engine\'s own cache, or remove the key')
    mode = cfg.engines.vllm.launch_mode
    if mode not in LAUNCH_MODES:
        raise ConfigError(path, "engines.vllm.launch_mode", f'{mode!r} is not one of "ray" or "mp"')
    if cfg.discovery.simulated_gpus < 0:
        raise ConfigError(
            path, "discovery.simulated_gpus", f"{cfg.discovery.simulated_gpus} must be 0 or more"
        )
    sup = cfg.supervisor
    if sup.log_lines < 1:
        raise ConfigError(path, "supervisor.log_lines", f"{sup.log_lines} must be at least 1")
    if sup.log_max_bytes < 1:
        raise ConfigError(path, "supervisor.log_max_bytes", f"{sup.log_max_bytes} must be at least 1")
    if sup.startup_max < sup.health_interval:
        raise ConfigError(
            path, "supervisor.startup_max",
            f"{sup.startup_max:g}s is shorter than supervisor.health_interval "
            f"({sup.health_interval:g}s): no engine could ever be seen ready",
        )
    if not 0 <= cfg.kv_relay_port <= 65535:
        raise ConfigError(path, "kv_relay_port", f"{cfg.kv_relay_port}: ports lie in 1..65535 (0: no relay)")
    lo, hi = cfg.port_range
    if not (1 <= lo <= 65535 and 1 <= hi <= 65535):
        raise ConfigError(path, "port_range", f"[{lo}, {hi}]: ports must lie in 1..65535")
    if lo > hi:
        raise ConfigError(path, "port_range", f"[{lo}, {hi}] is inverted: first must be <= last")
    if lo <= cfg.kv_relay_port <= hi:
        # The server hands out port_range to engines: one of them would take the relay's port.
        raise ConfigError(path, "kv_relay_port", f"{cfg.kv_relay_port} lies inside port_range [{lo}, {hi}], "
                          "which the server assigns to engines; pick a port outside it")
    check_key_file(
        path,
        "keys.secret_key",
        cfg.keys.secret_key,
        secret=True,
        hint="make it with `llmgw keys issue node NODE_ID --dir DIR` on the server",
    )
    check_key_file(
        path,
        "keys.server_key",
        cfg.keys.server_key,
        secret=False,
        hint="copy server.key from the folder `llmgw keys init` made on the server",
    )


def _check_fabrics(path: str, cfg: AgentConfig) -> None:
    names: dict[str, int] = {}
    hca_owner: dict[str, int] = {}
    for i, fab in enumerate(cfg.fabrics):
        if not fab.name.strip():
            raise ConfigError(path, f"fabrics[{i}].name", f"{fab.name!r} is empty")
        if fab.name in names:
            raise ConfigError(
                path,
                f"fabrics[{i}].name",
                f"{fab.name!r} is already the name of fabrics[{names[fab.name]}]",
            )
        names[fab.name] = i
        if not fab.hcas:
            raise ConfigError(
                path,
                f"fabrics[{i}].hcas",
                f"fabric {fab.name!r} lists no HCAs ({list(fab.hcas)!r}); a fabric needs at "
                "least one, e.g. hcas: [mlx5_0]",
            )
        if fab.rate_gbps < 0:
            raise ConfigError(path, f"fabrics[{i}].rate_gbps", f"{fab.rate_gbps:g} is negative")
        for hca in fab.hcas:
            if hca in hca_owner:
                other = hca_owner[hca]
                where = "this fabric" if other == i else f"fabrics[{other}]"
                raise ConfigError(
                    path,
                    f"fabrics[{i}].hcas",
                    f"HCA {hca!r} is already listed in {where}; an HCA belongs to one fabric",
                )
            hca_owner[hca] = i


def _check_model_dirs(path: str, cfg: AgentConfig) -> None:
    seen: dict[str, int] = {}
    for i, md in enumerate(cfg.model_dirs or ()):
        if not md.path.strip():
            raise ConfigError(path, f"model_dirs[{i}].path", f"{md.path!r} is empty")
        if md.path in seen:
            raise ConfigError(path, f"model_dirs[{i}]", f"{md.path!r} is already model_dirs[{seen[md.path]}]")
        seen[md.path] = i

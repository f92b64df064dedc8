"""`llmgw dev`'s folder: its options, keys, ports and the config files it writes.

Everything dev needs before anything runs (dev.py runs it): the checks of the options,
the keys (reused where the folder has them), ports kept from the last run in a kept
`--state-dir` where they are still free, and the server, agent, router and ctl configs.
"""

from __future__ import annotations

import os
import shlex
import socket
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomli_w
import yaml
from attrs import frozen

from llmgw.errors import UsageError
from llmgw.transport import keys

HOST = "127.0.0.1"
NODE_ID = "dev-node"
ADMIN = "dev-admin"
ROUTER = "dev-router"
ENGINE_STOP_TIMEOUT = 10.0  # SIGTERM -> SIGKILL for engines in dev


@frozen
class DevOptions:
    state_dir: str | None = None
    demo: bool = True
    port_base: int = 20000
    router_port: int = 8080
    real_gpus: bool = False
    simulated_gpus: int = 2
    vllm_bin: str = ""  # engines.vllm.bin ("": `vllm` on PATH)
    sglang_python: str = ""  # engines.sglang.python ("": `python3` on PATH)


@frozen
class DevFiles:
    root: Path
    keys_dir: Path
    server_toml: Path
    agent_yaml: Path
    router_toml: Path
    server_address: str
    server_metrics: str  # host:port of the server's /metrics and status page
    agent_metrics: str  # host:port of the agent's /metrics

    @property
    def admin_key(self) -> Path:
        return self.keys_dir / f"{ADMIN}.key_secret"

    @property
    def server_key(self) -> Path:
        return self.keys_dir / "server.key"

    @property
    def ctl_toml(self) -> Path:
        return self.root / "ctl.toml"

    def ctl_line(self, *args: str) -> str:
        return shlex.join(["llmgw", "ctl", "--config", str(self.ctl_toml), *args])


def _say(text: str) -> None:
    print(text, flush=True)


# ---- ports ----


def free_port(host: str = HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as trio's listeners do
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def check_options(opts: DevOptions) -> None:
    if not 0 <= opts.router_port <= 65535:
        raise UsageError(f"--router-port {opts.router_port}: a port is 0..65535 (0: any free port)")
    if not 1024 <= opts.port_base <= 65535 - 999:
        raise UsageError(f"--port-base {opts.port_base}: engines need 1000 ports from 1024..65535")
    if opts.simulated_gpus < 0:
        raise UsageError(f"--simulated-gpus {opts.simulated_gpus}: must be 0 or more")
    for flag, path in (("--vllm-bin", opts.vllm_bin), ("--sglang-python", opts.sglang_python)):
        if path and not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise UsageError(f"{flag} {path}: not an executable file")
    if opts.router_port and not port_is_free(HOST, opts.router_port):
        raise UsageError(
            f"port {opts.router_port} on {HOST} is in use (another llmgw dev or router?); "
            "pick another with --router-port N, or --router-port 0 for any free port"
        )


# ---- the folder: keys and configs ----


def make_keys(keys_dir: Path) -> None:
    """The server's pair and one key per peer; existing keys are reused."""
    if not (keys_dir / "server.key_secret").exists():
        keys.init_keys(str(keys_dir))
    for role, name in (("node", NODE_ID), ("admin", ADMIN), ("router", ROUTER)):
        if not (keys_dir / f"{name}.key_secret").exists():
            keys.issue_key(str(keys_dir), role, name)


def _kept_port(root: Path, file: str, read: Callable[[str], str], what: str, *, note: str = "",
               taken: frozenset[int] = frozenset()) -> int:
    """The port the last run in `root` gave `what` (the host:port or tcp:// address that
    `read` takes out of `file`'s text), where it is still free, so that a kept state
    folder's addresses stay the same from run to run; else any free port. `taken`: ports
    this run has given out already (free until bound, so a new pick could repeat one)."""
    try:
        port = int(read((root / file).read_text()).rsplit(":", 1)[1])
    except (OSError, tomllib.TOMLDecodeError, yaml.YAMLError, KeyError, TypeError, IndexError,
            ValueError, AttributeError):
        return _free_port_but(taken)  # a first run, or a file that is not ours to trust
    if 1024 <= port <= 65535 and port not in taken and port_is_free(HOST, port):
        return port
    new = _free_port_but(taken)
    _say(f"the {what}'s port of the last run ({port}) is taken; it is {new} this time{note}")
    return new


def _free_port_but(taken: frozenset[int]) -> int:
    while (port := free_port()) in taken:
        pass  # the kernel handed out one it gave us before: ask again
    return port


def server_port(root: Path) -> int:
    """The server's port: kept from the last run where free (ctl.toml follows it)."""
    return _kept_port(root, "server.toml", lambda t: tomllib.loads(t)["bind"], "server",
                      note=f" ({root / 'ctl.toml'} says so)")


def metrics_ports(root: Path, taken: frozenset[int]) -> tuple[int, int]:
    """The server's and the agent's metrics listeners: free ports, never the production
    defaults (9464, 9465), so that a second dev, or one beside a real server or agent,
    starts; kept from the last run where free, and none of `taken`."""
    server = _kept_port(root, "server.toml", lambda t: tomllib.loads(t)["metrics_bind"],
                        "status page", taken=taken)
    agent = _kept_port(root, "agent.yaml", lambda t: yaml.safe_load(t)["metrics_bind"],
                       "agent metrics", taken=taken | {server})
    return server, agent


def kv_relay_port(root: Path, opts: DevOptions, taken: frozenset[int]) -> int:
    """The agent's KV-event relay: a free port, never the production default (7444), so
    that a second dev, or one beside a real agent, starts; kept from the last run where
    free, none of `taken` and none of the engines' port range."""
    engines = frozenset(range(opts.port_base, opts.port_base + 1000))
    return _kept_port(root, "agent.yaml", lambda t: f":{yaml.safe_load(t)['kv_relay_port']}",
                      "agent's KV relay", taken=taken | engines)


def write_configs(root: Path, opts: DevOptions, router_port: int) -> DevFiles:
    keys_dir = root / "keys"
    make_keys(keys_dir)
    zmq_port = server_port(root)
    address = f"tcp://{HOST}:{zmq_port}"
    server_metrics_port, agent_metrics_port = metrics_ports(root, frozenset({zmq_port, router_port}))
    server_metrics, agent_metrics = f"{HOST}:{server_metrics_port}", f"{HOST}:{agent_metrics_port}"
    relay_port = kv_relay_port(root, opts, frozenset({zmq_port, router_port, server_metrics_port,
                                                      agent_metrics_port}))
    server = {
        "bind": address,
        "metrics_bind": server_metrics,
        "keys_dir": str(keys_dir),
        "state_dir": str(root / "server"),
        "heartbeat_interval": "1s",
    }
    discovery: dict[str, Any] = {
        "ib_root": str(root / "no-infiniband"),
        "simulated_gpus": opts.simulated_gpus,
    }
    if not opts.real_gpus:
        # No GPU source answers, so the simulated GPUs stand in even on a GPU machine.
        discovery.update(prefer_nvml=False, nvidia_smi=str(root / "no-nvidia-smi"))
    agent = {
        "node_id": NODE_ID,
        "server": address,
        "keys": {"secret_key": str(keys_dir / f"{NODE_ID}.key_secret"),
                 "server_key": str(keys_dir / "server.key")},
        "mgmt_addr": HOST,
        "metrics_bind": agent_metrics,
        "heartbeat_interval": "1s",
        "reconnect_base": "200ms",
        "reconnect_max": "2s",
        "discovery": discovery,
        "supervisor": {"work_dir": str(root / "agent"), "stop_timeout": f"{ENGINE_STOP_TIMEOUT:g}s",
                       "health_interval": "500ms"},
        "port_range": [opts.port_base, opts.port_base + 999],
        "kv_relay_port": relay_port,
    }
    engines: dict[str, Any] = {}
    if opts.vllm_bin:
        engines["vllm"] = {"bin": os.path.abspath(opts.vllm_bin)}
    if opts.sglang_python:
        engines["sglang"] = {"python": os.path.abspath(opts.sglang_python)}
    if engines:
        agent["engines"] = engines
    router = {
        "bind": f"{HOST}:{router_port}",
        "server": address,
        "table_poll_interval": "500ms",
        "keys": {"secret_key": str(keys_dir / f"{ROUTER}.key_secret"),
                 "server_key": str(keys_dir / "server.key")},
    }
    files = DevFiles(root, keys_dir, root / "server.toml", root / "agent.yaml", root / "router.toml",
                     address, server_metrics, agent_metrics)
    files.server_toml.write_text(tomli_w.dumps(server))
    files.agent_yaml.write_text(yaml.safe_dump(agent, sort_keys=False))
    files.router_toml.write_text(tomli_w.dumps(router))
    # What `llmgw ctl --config ROOT/ctl.toml` reads (llmgw.ctl.settings), for the printed
    # ctl line: the admin key of this folder and the server of this run.
    files.ctl_toml.write_text(tomli_w.dumps({"server": address, "key": str(files.admin_key),
                                             "server_key": str(files.server_key)}))
    return files

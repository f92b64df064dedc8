"""Real llmgw processes on 127.0.0.1 for integration tests: keys, configs, server, agents.

Every process started here is killed by pid when its test ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from fakes.engines import free_port
from llmgw.transport import keys

LLMGW = [sys.executable, "-m", "llmgw.cli"]


def run_cli(*args: str, timeout: float = 30, env: Mapping[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LLMGW, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def engine_pids(root: Path) -> dict[int, str]:
    """Live engine processes started under `root` (their cwd is below it): pid -> the
    LLMGW_REPLICA_ID tag in their environment. Engines outlive agents, so tests look for
    them here rather than through any agent."""
    found: dict[int, str] = {}
    prefix = str(root)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if not os.readlink(f"/proc/{entry}/cwd").startswith(prefix):
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        tag = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"LLMGW_REPLICA_ID=")), "")
        if tag:
            found[int(entry)] = tag
    return found


def _cwd_below(root: Path) -> list[int]:
    prefix = str(root)
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/cwd").startswith(prefix):
                    found.append(int(entry))
            except OSError:
                continue
    return found


def simulated(name: str, model: str = "", *, extra: str = "") -> str:
    """A deployment of one replica on one simulated GPU, as YAML (`extra`: more keys)."""
    return (f"name: {name}\nmodel: {model or 'org/' + name}\nengine: simulated\n"
            f"gpus_per_node: 1\nreplicas: 1\n{extra}")


def kill_engines(root: Path) -> None:
    """Safety net for a test's end: SIGKILL, by pid, every process started under `root`
    (its cwd is below it). Not by tag alone: vLLM's EngineCore and workers set their
    process title, which overwrites /proc/PID/environ, so once the engine's main process
    is gone nothing there names them."""
    for pid in {*engine_pids(root), *_cwd_below(root)}:
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Proc:
    def __init__(self, argv: list[str], log: Path, env: Mapping[str, str] | None = None) -> None:
        self.argv = argv
        self.log = log
        self._fh = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.p = subprocess.Popen(argv, stdout=self._fh, stderr=subprocess.STDOUT,
                                  env={**os.environ, **(env or {})})

    @property
    def pid(self) -> int:
        return self.p.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float = 15) -> int:
        return self.p.wait(timeout=timeout)

    def wait_line(self, text: str, timeout: float, what: str) -> None:
        """Until `text` is in its log; it must still be running then."""
        wait_for(lambda: text in self.text() or self.p.poll() is not None, timeout, what)
        assert self.p.poll() is None, self.text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int | None:
        if self.p.poll() is None:
            os.kill(self.p.pid, sig)
            try:
                self.p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.p.pid, signal.SIGKILL)
                self.p.wait(timeout=5)
        self._fh.close()
        return self.p.returncode


class Cluster:
    """A keys folder, a server config and helpers to start server and agents."""

    def __init__(self, root: Path, *, heartbeat: str = "1s", lost_after: str = "60s",
                 extra_server: str = "") -> None:
        self.root = root
        self.keys_dir = root / "keys"
        keys.init_keys(str(self.keys_dir))
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.server_toml = root / "server.toml"
        self.server_toml.write_text(
            f'bind = "{self.address}"\nkeys_dir = "{self.keys_dir}"\nstate_dir = "{root / "state"}"\n'
            f'heartbeat_interval = "{heartbeat}"\nlost_after = "{lost_after}"\n{extra_server}'
            # Tests run side by side: no listener on the default port unless asked.
            + ("" if "metrics_bind" in extra_server else 'metrics_bind = ""\n')
        )
        self.procs: list[Proc] = []
        self._ranges = 0
        keys.issue_key(str(self.keys_dir), "admin", "ops")
        self.admin_key = str(self.keys_dir / "ops.key_secret")
        self.server_key = str(self.keys_dir / "server.key")

    def start_server(self) -> Proc:
        p = Proc([*LLMGW, "server", "--config", str(self.server_toml)], self.root / "server.log")
        self.procs.append(p)
        p.wait_line("listening on", 20, "server start")
        return p

    def up(self, agents: Mapping[str, Mapping[str, Any]], timeout: float = 20) -> Proc:
        """The server, then an agent per node id (its config overrides), until every node
        is ready. Returns the server."""
        server = self.start_server()
        for node, kw in agents.items():
            self.start_agent(node, **kw)
        self.wait_states(dict.fromkeys(agents, "ready"), timeout=timeout)
        return server

    def agent_config(self, node_id: str, *, key_name: str | None = None, **overrides: Any) -> Path:
        name = key_name or node_id
        if not (self.keys_dir / f"{name}.key_secret").exists():
            keys.issue_key(str(self.keys_dir), "node", name)
        work = self.root / "agents" / node_id
        work.mkdir(parents=True, exist_ok=True)
        cfg: dict[str, Any] = {
            "node_id": node_id,
            "server": self.address,
            "keys": {"secret_key": str(self.keys_dir / f"{name}.key_secret"),
                     "server_key": self.server_key},
            "mgmt_addr": "127.0.0.1",
            "heartbeat_interval": "1s",
            "reconnect_base": "200ms",
            "reconnect_max": "2s",
            "discovery": {"ib_root": str(work / "no-ib"), "prefer_nvml": False,
                          "nvidia_smi": str(work / "no-nvidia-smi")},
            "supervisor": {"work_dir": str(work / "work"), "stop_timeout": "5s",
                           "health_interval": "500ms"},
            # Every test "node" shares 127.0.0.1: give each its own ports.
            "port_range": list(self._port_range()),
            "metrics_bind": "",  # no listener on the default port unless asked
            # Nor a KV-event relay (every test node shares 127.0.0.1): kv_relay_port=N to have one.
            "kv_relay_port": 0,
        }
        for k, v in overrides.items():
            if isinstance(v, dict) and isinstance(cfg.get(k), dict):
                cfg[k] = {**cfg[k], **v}
            else:
                cfg[k] = v
        path = work / "agent.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def _port_range(self) -> tuple[int, int]:
        self._ranges += 1
        base = 20000 + (self.port % 50) * 240 + self._ranges * 80
        return base, base + 79

    def start_agent(self, node_id: str, **kw: Any) -> Proc:
        cfg = self.agent_config(node_id, **kw)
        p = Proc([*LLMGW, "agent", "--config", str(cfg)], cfg.parent / "agent.log")
        self.procs.append(p)
        return p

    def router_config(self, name: str, port: int, extra: str = "") -> Path:
        """<root>/<name>.toml for a router with its own key, on `port`; `extra` is
        appended to its TOML before the [keys] table."""
        if not (self.keys_dir / f"{name}.key_secret").exists():
            keys.issue_key(str(self.keys_dir), "router", name)
        cfg = self.root / f"{name}.toml"
        cfg.write_text(f'bind = "127.0.0.1:{port}"\nserver = {self.router_servers()}\n{extra}'
                       f'[keys]\nsecret_key = "{self.keys_dir / f"{name}.key_secret"}"\n'
                       f'server_key = "{self.server_key}"\n')
        return cfg

    def start_router(self, name: str = "r1", *, port: int | None = None,
                     extra: str = "") -> tuple[Proc, int]:
        """A router (router_config's), on `port` (a free one unless given)."""
        port = port or free_port()
        cfg = self.router_config(name, port, extra)
        p = Proc([*LLMGW, "router", "--config", str(cfg)], self.root / f"{name}.log")
        self.procs.append(p)
        return p, port

    def router_servers(self) -> str:
        """A router's `server` value in TOML: this cluster's address."""
        return json.dumps(self.address)

    def replicas(self) -> dict[str, dict[str, Any]]:
        return {x["id"]: x for x in self.ok_json("get", "replicas")}

    def ok(self, *args: str) -> str:
        """A ctl command that must succeed: its stdout."""
        r = self.ctl(*args)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def ok_json(self, *args: str) -> Any:
        return json.loads(self.ok(*args, "-o", "json"))

    def apply(self, name: str, body: str) -> Path:
        """`body` written to <root>/<name>.yaml and applied (it must be accepted)."""
        f = self.root / f"{name}.yaml"
        f.write_text(body)
        self.ok("apply", "-f", str(f))
        return f

    def apikey(self, name: str, *flags: str) -> str:
        """A new API key's secret (`flags`: ctl apikey create's, --rpm 10 and so on)."""
        return str(self.ok_json("apikey", "create", name, *flags)["secret"])

    def ctl(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return run_cli("ctl", "--server", self.address, "--key", self.admin_key,
                       "--server-key", self.server_key, *args, timeout=timeout)

    def status(self) -> dict[str, Any]:
        r = self.ctl("status", "-o", "json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)  # type: ignore[no-any-return]

    def node_states(self) -> dict[str, str]:
        return {n["id"]: n["state"] for n in self.status()["nodes"]}

    def wait_states(self, want: Mapping[str, str], timeout: float = 20) -> None:
        wait_for(lambda: all(self.node_states().get(k) == v for k, v in want.items()), timeout,
                 f"node states {dict(want)}", interval=0.3)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        kill_engines(self.root)

"""Several `llmgw server` processes on one PostgreSQL database (issue 14), with agents and
ctl that know every server's address. Built on live.Cluster; every process is killed by
pid at the end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from fakes.engines import free_port
from fakes.live import LLMGW, Cluster, Proc, run_cli, wait_for

FROZEN_SERVER = Path(__file__).with_name("frozen_server.py")
LEADING = re.compile(r"leading with epoch (\d+)|stepped down from epoch (\d+)")


class HACluster(Cluster):
    def __init__(self, root: Path, pg_url: str, *, servers: int = 2, lease: str = "3s",
                 heartbeat: str = "1s", lost_after: str = "30s", extra_server: str = "") -> None:
        super().__init__(root, heartbeat=heartbeat, lost_after=lost_after)
        self.ports = [free_port() for _ in range(servers)]
        self.addresses = [f"tcp://127.0.0.1:{p}" for p in self.ports]
        self.address = self.addresses[0]
        self.tomls: list[Path] = []
        for i, address in enumerate(self.addresses):
            toml = root / f"server-{i}.toml"
            toml.write_text(
                f'bind = "{address}"\nkeys_dir = "{self.keys_dir}"\nstate_dir = "{root / f"state-{i}"}"\n'
                f'heartbeat_interval = "{heartbeat}"\nlost_after = "{lost_after}"\nmetrics_bind = ""\n'
                f'{extra_server}[store]\nurl = "{pg_url}"\nlease = "{lease}"\n')
            toml.chmod(0o600)
            self.tomls.append(toml)
        self.servers: dict[int, Proc] = {}
        self._runs = 0

    def start_server(self, i: int = 0, env: dict[str, str] | None = None,  # type: ignore[override]
                     freeze: Path | None = None) -> Proc:
        """Server i. `freeze`: a file that, once it holds an SQL prefix, stops the server
        inside the fenced transaction whose statement starts with it (frozen_server.py)."""
        self._runs += 1
        llmgw = LLMGW if freeze is None else [sys.executable, str(FROZEN_SERVER), str(freeze)]
        p = Proc([*llmgw, "server", "--config", str(self.tomls[i])],
                 self.root / f"server-{i}.run{self._runs}.log", env=env)
        self.procs.append(p)
        self.servers[i] = p
        wait_for(lambda: "standby on" in p.text() or "listening on" in p.text() or p.p.poll() is not None,
                 20, f"server {i} start")
        assert p.p.poll() is None, p.text()
        return p

    def leads(self, i: int) -> int | None:
        """The epoch server i leads with now (by its log), or None."""
        p = self.servers.get(i)
        if p is None or p.p.poll() is not None:
            return None
        found = LEADING.findall(p.text())
        if not found or not found[-1][0]:
            return None
        return int(found[-1][0])

    def leader(self) -> int | None:
        leading = [i for i in self.servers if self.leads(i) is not None]
        assert len(leading) <= 1, f"two servers say they lead: {leading}"
        return leading[0] if leading else None

    def wait_leader(self, timeout: float = 20, *, not_: int | None = None) -> int:
        """The index of the server that leads, once one does (and it is not `not_`)."""
        def found() -> list[int] | None:
            i = self.leader()
            return [i] if i is not None and i != not_ else None
        return int(wait_for(found, timeout, "a leader", interval=0.05)[0])

    def agent_config(self, node_id: str, **overrides: Any) -> Path:
        overrides.setdefault("server", list(self.addresses))
        return super().agent_config(node_id, **overrides)

    def router_servers(self) -> str:
        return json.dumps(self.addresses)  # every server: a router follows the leader

    def ctl(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        servers = [a for addr in self.addresses for a in ("--server", addr)]
        return run_cli("ctl", *servers, "--key", self.admin_key, "--server-key", self.server_key,
                       *args, timeout=timeout)

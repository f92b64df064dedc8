"""API keys kept by the server, end to end (issue 24): a server, an agent with simulated
GPUs, two simulated engines and a router, all real processes on loopback. Keys made with
`ctl apikey create` work on the router within a key table refresh; a key limited to one
model gets 404 for the other; a revoked key is refused (401) within 2 s of `ctl apikey
revoke` returning, while other keys go on working."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fakes.engines import free_port
from fakes.live import LLMGW, Cluster, Proc, wait_for
from llmgw.transport import keys

pytestmark = pytest.mark.slow

DEPLOYMENT = """name: {name}
model: org/{name}
engine: simulated
gpus_per_node: 1
replicas: 1
"""


def ask(port: int, model: str, secret: str = "") -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"content-type": "application/json"}
    if secret:
        headers["authorization"] = f"Bearer {secret}"
    try:
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": model, "prompt": "p", "max_tokens": 2}), headers)
        r = conn.getresponse()
        body = r.read()
    except OSError as exc:  # the router not listening yet
        return 0, {"raw": str(exc)}
    finally:
        conn.close()
    try:
        return r.status, json.loads(body)
    except ValueError:
        return r.status, {"raw": body[:200].decode(errors="replace")}


class Rig:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.c = Cluster(root)
        self.port = free_port()
        self.router: Proc | None = None

    def start(self) -> None:
        self.c.start_server()
        self.c.start_agent("n1", discovery={"simulated_gpus": 2})
        self.c.wait_states({"n1": "ready"})
        for name in ("a", "b"):
            f = self.root / f"{name}.yaml"
            f.write_text(DEPLOYMENT.format(name=name))
            self.ok("apply", "-f", str(f))
        keys.issue_key(str(self.c.keys_dir), "router", "r1")
        cfg = self.root / "router.toml"
        cfg.write_text(f'bind = "127.0.0.1:{self.port}"\nserver = "{self.c.address}"\n'
                       'key_table_interval = "1s"\n'
                       f'[keys]\nsecret_key = "{self.c.keys_dir / "r1.key_secret"}"\n'
                       f'server_key = "{self.c.server_key}"\n')
        self.router = Proc([*LLMGW, "router", "--config", str(cfg)], self.root / "router.log")
        self.c.procs.append(self.router)
        for model in ("org/a", "org/b"):
            wait_for(lambda m=model: ask(self.port, m)[0] == 200, 60, f"{model} served")  # type: ignore[misc]

    def ok(self, *args: str) -> str:
        r = self.c.ctl(*args)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def create(self, *args: str) -> str:
        return str(json.loads(self.ok("apikey", "create", *args, "-o", "json"))["secret"])


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    try:
        yield r
    finally:
        r.c.close()


def test_keys_from_the_store_on_a_router(rig: Rig) -> None:
    rig.start()  # no key in the store: no authentication, as before keys
    only_a = rig.create("team-a", "--models", "org/a", "--rpm", "100")
    every = rig.create("team-b")
    assert only_a.startswith("llmgw-") and only_a != every
    # The first key in the store turns authentication on, within a refresh.
    wait_for(lambda: ask(rig.port, "org/a")[0] == 401, 3, "a request without a key refused")
    wait_for(lambda: ask(rig.port, "org/b", every)[0] == 200, 3, "the newest key working")
    code, body = ask(rig.port, "org/a", only_a)
    assert code == 200, body
    code, body = ask(rig.port, "org/b", only_a)
    assert code == 404 and body["error"]["code"] == "model_not_found", body
    assert ask(rig.port, "org/b", every)[0] == 200
    conn = http.client.HTTPConnection("127.0.0.1", rig.port, timeout=10)
    conn.request("GET", "/metrics")
    metrics = conn.getresponse().read().decode()
    conn.close()
    assert "llmgw_router_api_keys 2.0" in metrics and "llmgw_router_limits_server_lost 0.0" in metrics
    code, body = ask(rig.port, "org/a", "llmgw-" + "x" * 43)
    assert code == 401 and body["error"]["code"] == "invalid_api_key", body

    # A name in use is the server's refusal, one line.
    r = rig.c.ctl("apikey", "create", "team-a")
    assert r.returncode == 1 and "exists" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    listed = {k["name"]: k for k in json.loads(rig.ok("apikey", "list", "-o", "json"))}
    assert listed["team-a"]["models"] == ["org/a"] and listed["team-a"]["rpm"] == 100
    assert listed["team-a"]["prefix"] == only_a[:12]
    assert only_a not in json.dumps(listed)

    rig.ok("apikey", "revoke", "team-a")
    revoked_at = time.monotonic()

    def refused() -> bool:
        code, body = ask(rig.port, "org/a", only_a)
        return code == 401 and "revoked" in body["error"]["message"]
    wait_for(refused, 5, "the revoked key refused", interval=0.05)
    took = time.monotonic() - revoked_at
    print(f"revoked key refused {took:.2f}s after ctl apikey revoke returned")
    assert took <= 2.0, f"the revoked key was refused {took:.2f}s after ctl apikey revoke"
    assert ask(rig.port, "org/b", every)[0] == 200
    assert json.loads(rig.ok("apikey", "describe", "team-a", "-o", "json"))["state"] == "revoked"

"""API keys kept by the server, end to end (issue 24): a server, an agent with simulated
GPUs, two simulated engines and a router, all real processes on loopback. Keys made with
`ctl apikey create` work on the router within a key table refresh; a key limited to one
model gets 404 for the other; a revoked key is refused (401) within 2 s of `ctl apikey
revoke` returning, while other keys go on working."""

from __future__ import annotations

import http.client
import json
import time
from typing import Any

import pytest

from fakes.live import Cluster, simulated, wait_for
from fakes.web import post

pytestmark = pytest.mark.slow


# Priority classes on the router; keys of neither class wait as interactive.
CLASSES = 'classes = [{name = "interactive", ttl = "10s"}, {name = "batch", ttl = "60s"}]\n'


def ask(port: int, model: str, secret: str = "") -> tuple[int, Any]:
    r = post(port, {"model": model, "prompt": "p", "max_tokens": 2}, secret, timeout=10)
    return r.status, r.json()


def start(c: Cluster) -> int:
    """Two models, one replica each, and a router that reads the key table every 1 s,
    serving both. Returns the router's port."""
    c.up({"n1": {"discovery": {"simulated_gpus": 2}}})
    for name in ("a", "b"):
        c.apply(name, simulated(name))
    _, port = c.start_router(extra='key_table_interval = "1s"\n' + CLASSES)
    for model in ("org/a", "org/b"):
        wait_for(lambda m=model: ask(port, m)[0] == 200, 60, f"{model} served")  # type: ignore[misc]
    return port


def test_keys_from_the_store_on_a_router(cluster: Cluster) -> None:
    port = start(cluster)  # no key in the store: no authentication, as before keys
    only_a = cluster.apikey("team-a", "--models", "org/a", "--rpm", "100")
    every = cluster.apikey("team-b")
    assert only_a.startswith("llmgw-") and only_a != every
    # The first key in the store turns authentication on, within a refresh.
    wait_for(lambda: ask(port, "org/a")[0] == 401, 3, "a request without a key refused")
    wait_for(lambda: ask(port, "org/b", every)[0] == 200, 3, "the newest key working")
    code, body = ask(port, "org/a", only_a)
    assert code == 200, body
    code, body = ask(port, "org/b", only_a)
    assert code == 404 and body["error"]["code"] == "model_not_found", body
    assert ask(port, "org/b", every)[0] == 200
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    metrics = conn.getresponse().read().decode()
    conn.close()
    assert "llmgw_router_api_keys 2.0" in metrics and "llmgw_router_limits_server_lost 0.0" in metrics
    code, body = ask(port, "org/a", "llmgw-" + "x" * 43)
    assert code == 401 and body["error"]["code"] == "invalid_api_key", body

    # A name in use is the server's refusal, one line.
    r = cluster.ctl("apikey", "create", "team-a")
    assert r.returncode == 1 and "exists" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    listed = {k["name"]: k for k in json.loads(cluster.ok("apikey", "list", "-o", "json"))}
    assert listed["team-a"]["models"] == ["org/a"] and listed["team-a"]["rpm"] == 100
    assert listed["team-a"]["prefix"] == only_a[:12]
    assert only_a not in json.dumps(listed)

    cluster.ok("apikey", "revoke", "team-a")
    revoked_at = time.monotonic()

    def refused() -> bool:
        code, body = ask(port, "org/a", only_a)
        return code == 401 and "revoked" in body["error"]["message"]
    wait_for(refused, 5, "the revoked key refused", interval=0.05)
    took = time.monotonic() - revoked_at
    print(f"revoked key refused {took:.2f}s after ctl apikey revoke returned")
    assert took <= 2.0, f"the revoked key was refused {took:.2f}s after ctl apikey revoke"
    assert ask(port, "org/b", every)[0] == 200
    assert json.loads(cluster.ok("apikey", "describe", "team-a", "-o", "json"))["state"] == "revoked"

    # A key's priority class goes from ctl through the server's key table to the router,
    # whose queue counts its requests in that class.
    batch = cluster.apikey("team-c", "--class", "batch")
    assert json.loads(cluster.ok("apikey", "describe", "team-c", "-o", "json"))["priority_class"] == "batch"
    wait_for(lambda: ask(port, "org/a", batch)[0] == 200, 3, "the batch key working")

    def counted() -> str:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        return text
    text = counted()
    assert 'llmgw_router_queue_wait_seconds_count{class="batch",model="org/a"} 1.0' in text, text
    assert 'llmgw_router_queue_wait_seconds_count{class="interactive",model="org/b"}' in text

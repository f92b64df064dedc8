"""Every engine's own API key end to end (issue 30 item 2): a server, an agent, a router
and the simulated engine, real processes on 127.0.0.1.

On the network the engine refuses, without its key, its dev endpoints (/sleep,
/wake_up, /is_sleeping, /collective_rpc, ...), /metrics and /v1 alike (401), as vLLM under
llmgw's guard does; /health stays open. The router serves through it (sending the
engine's key, never the client's Authorization); the agent's health probes, its LoRA
adapter loads and its sleep and wake work (each would be refused without the key); an
agent restarted adopts the engine with the same key, and its calls still work."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fakes.adapters import write_adapter
from fakes.engine_keys import auth, record_key, url_key
from fakes.live import Cluster, engine_pids, wait_for

pytestmark = [pytest.mark.slow]

DEPLOYMENT = """name: d
model: org/sim
engine: simulated
gpus_per_node: 1
replicas: 1
max_loras: 2
adapters:
{adapters}autoscale:
  min: 0
  max: 1
  in_flight_per_replica: 2
  scale_up_after: 1s
  scale_down_after: 2s
  idle_to_zero: {idle}
  sleep_when_idle: true
env:
  LLMGW_SIM_TOKENS_PER_SECOND: "200"
  LLMGW_SIM_TTFT: "0.01"
"""

# What vLLM with dev mode and runtime LoRA mounts beyond /v1, and /v1 itself: each refused.
CLOSED = [("POST", "/sleep?level=1"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
          ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"), ("GET", "/server_info"),
          ("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
          ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter")]


def _status(url: str, method: str = "GET", headers: dict[str, str] | None = None,
            body: Any = None) -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except urllib.error.URLError:  # not listening (yet)
        return 0


def _complete(router: str, model: str) -> int:
    # A client's own Authorization: the router must not pass it on (the engine would
    # refuse it), and sends the engine's key instead.
    return _status(f"{router}/v1/completions", "POST", {"Authorization": "Bearer client-tenant-key"},
                   {"model": model, "prompt": "hi", "max_tokens": 2})


def _endpoint(c: Cluster) -> str:
    return str(next(r["endpoint"] for r in c.status()["replicas"] if r.get("endpoint")))


def _asleep(endpoint: str) -> bool:
    req = urllib.request.Request(endpoint + "/is_sleeping", headers=auth(url_key(endpoint)))
    with urllib.request.urlopen(req, timeout=5) as r:
        return bool(json.loads(r.read())["is_sleeping"])


def _sleeps_and_wakes(router: str, endpoint: str) -> None:
    """Idle: the agent puts the engine to sleep (POST /sleep, with the key); a request
    through the router wakes it (POST /wake_up and /is_sleeping, with the key)."""
    wait_for(lambda: _asleep(endpoint), 30, "the engine asleep", interval=0.2)
    assert _complete(router, "org/sim") == 200
    assert not _asleep(endpoint)


@pytest.fixture
def c(make_cluster: Callable[..., Cluster]) -> Cluster:
    return make_cluster()


def _start(c: Cluster) -> str:
    """Server, agent, router: the router's URL."""
    c.up({"n1": {"discovery": {"simulated_gpus": 1}}})
    proc, port = c.start_router("r1", extra='table_poll_interval = "200ms"\ncold_start_budget = "60s"\n')
    proc.wait_line("router listening", 20, "router start")
    return f"http://127.0.0.1:{port}"


def _deploy(c: Cluster, router: str, tmp_path: Path, idle: str, adapters: tuple[str, ...] = ("sql",)) -> None:
    """The deployment applied with `adapters`, until the router serves each."""
    lines = "".join(f"  - {{name: d-{a}, path: {write_adapter(tmp_path / 'adapters' / a)}}}\n"
                    for a in adapters)
    c.apply("d", DEPLOYMENT.format(adapters=lines, idle=idle))
    for a in adapters:  # each loaded by the agent on the running engine, with the key
        wait_for(lambda a=a: _complete(router, f"d-{a}") == 200, 60, f"d-{a} served", interval=0.3)  # type: ignore[misc]
    assert _complete(router, "org/sim") == 200


def _restart_agent(c: Cluster) -> None:
    """SIGTERM the agent (its engines live on), start it again: it adopts them."""
    (agent,) = [p for p in c.procs if "agent" in p.argv and p.p.poll() is None]
    pids = set(engine_pids(c.root))
    agent.stop(signal.SIGTERM)
    c.start_agent("n1", discovery={"simulated_gpus": 1})
    c.wait_states({"n1": "ready"}, timeout=30)
    assert set(engine_pids(c.root)) == pids  # the same process, not a new one


def test_engines_refuse_without_their_key_and_llmgw_sends_it(c: Cluster, tmp_path: Path) -> None:
    router = _start(c)
    _deploy(c, router, tmp_path, idle="1h")
    endpoint = _endpoint(c)
    key = record_key(c.root, "d-0")
    assert key.startswith("llmgw-") and url_key(endpoint) == key

    assert _status(endpoint + "/health") == 200  # open, as under llmgw's guard
    for method, path in CLOSED:
        assert _status(endpoint + path, method, body={} if method == "POST" else None) == 401, path
        assert _status(endpoint + path, method, {"Authorization": "Bearer llmgw-wrong"},
                       {} if method == "POST" else None) == 401, path
    assert _status(endpoint + "/v1/models", headers=auth(key)) == 200
    assert _status(endpoint + "/metrics", headers=auth(key)) == 200
    # The key goes to routers only: an admin's ctl never shows it.
    for args in (("get", "replicas", "-o", "json"), ("status", "-o", "json")):
        assert key not in c.ok(*args)

    # The agent restarts and adopts the engine with the key of its record: an adapter
    # added now is loaded by the adopting agent (GET /v1/models, POST
    # /v1/load_lora_adapter: refused without the key) and served.
    _restart_agent(c)
    assert record_key(c.root, "d-0") == key and url_key(endpoint) == key
    _deploy(c, router, tmp_path, idle="1h", adapters=("sql", "chat"))


@pytest.mark.live_long  # waits out idle windows
def test_sleep_and_wake_carry_the_key_before_and_after_adoption(c: Cluster, tmp_path: Path) -> None:
    router = _start(c)
    _deploy(c, router, tmp_path, idle="2s")
    endpoint = _endpoint(c)
    _sleeps_and_wakes(router, endpoint)
    _restart_agent(c)
    _sleeps_and_wakes(router, endpoint)

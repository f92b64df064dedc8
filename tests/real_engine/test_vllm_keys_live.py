"""A real vLLM under llmgw requires its own key everywhere but /health (issue 30 item 2).

llmgw's agent starts vLLM's CPU build on the tiny Llama with dev mode on
(VLLM_SERVER_DEV_MODE=1: /reset_prefix_cache, /server_info, /collective_rpc,
/is_sleeping mounted), as sleep_when_idle does. vLLM's own key check covers /v1 only; the
plan adds llmgw's guard (--middleware llmgw_engine_guard.EngineKeyGuard, its folder on
PYTHONPATH, the key in VLLM_API_KEY). Checked against the engine itself: without the key,
or with a wrong one, /v1 and every dev endpoint and /metrics answer 401; with it they
answer; /health answers without. The agent's health probe made it ready and the router
serves through it (with the engine's key, not the client's)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fakes.engine_keys import auth, record_key, url_key
from fakes.live import Cluster, wait_for
from fakes.nvidia_smi import pcie_box
from fakes.vllm_rig import ENGINE_ENV, READY_TIMEOUT, engine_log, leaders, tiny_yaml, vllm_agent
from fakes.web import post

pytestmark = pytest.mark.real_engine


def _status(url: str, method: str = "GET", headers: dict[str, str] | None = None,
            body: Any = None) -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


@pytest.fixture(scope="module")
def served(vllm_venv: Path, tiny_model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, int, str]]:
    root = tmp_path_factory.mktemp("vllm-keys")
    c = Cluster(root, heartbeat="1s", lost_after="60s")
    try:
        c.start_server()
        c.start_agent("cpu-1", **vllm_agent(vllm_venv, pcie_box(root / "smi")))
        c.wait_states({"cpu-1": "ready"})
        secret = c.apikey("k")
        _, port = c.start_router("edge")
        env = json.dumps({**ENGINE_ENV, "VLLM_SERVER_DEV_MODE": "1"})
        c.apply("tiny", tiny_yaml(model=str(tiny_model), extra="served_name: tiny\n")
                .replace(f"env: {json.dumps(ENGINE_ENV)}", f"env: {env}"))
        t0 = time.monotonic()
        wait_for(lambda: next(iter(c.replicas().values()), {}).get("state") == "ready",
                 READY_TIMEOUT, f"vLLM replica ready (log: {engine_log(root)})", interval=1.0)
        print(f"vLLM ready under the agent in {time.monotonic() - t0:.0f}s")
        yield c, port, secret
    finally:
        c.close()


CLOSED = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics"),
          ("GET", "/server_info"), ("POST", "/reset_prefix_cache"), ("GET", "/is_sleeping"),
          ("POST", "/collective_rpc"), ("POST", "/sleep?level=1"), ("POST", "/wake_up"),
          ("GET", "/ping"), ("POST", "/invocations"), ("GET", "/version")]


def test_vllm_refuses_without_its_key_and_serves_llmgw_with_it(
        served: tuple[Cluster, int, str]) -> None:
    c, port, secret = served
    endpoint = str(next(iter(c.replicas().values()))["endpoint"])
    key = record_key(c.root, "tiny-0")
    assert key and url_key(endpoint) == key  # VLLM_API_KEY in the engine's environment
    (leader,) = leaders(c.root)
    argv = Path(f"/proc/{leader}/cmdline").read_bytes().split(b"\0")
    assert key.encode() not in b" ".join(argv)  # never on its command line
    assert b"llmgw_engine_guard.EngineKeyGuard" in argv

    assert _status(endpoint + "/health") == 200
    for method, path in CLOSED:
        body = {} if method == "POST" else None
        assert _status(endpoint + path, method, body=body) == 401, path
        assert _status(endpoint + path, method, {"Authorization": "Bearer llmgw-wrong"}, body) == 401, path
    # With the key: what vLLM itself then answers (dev mode on).
    assert _status(endpoint + "/v1/models", headers=auth(key)) == 200
    assert _status(endpoint + "/metrics", headers=auth(key)) == 200
    assert _status(endpoint + "/server_info", headers=auth(key)) == 200
    assert _status(endpoint + "/reset_prefix_cache", "POST", auth(key), {}) == 200
    assert _status(endpoint + "/is_sleeping", headers=auth(key)) == 200
    # Through the router, with the tenant's key: the router sends the engine's own.
    probe = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    wait_for(lambda: post(port, probe, secret, timeout=60)[0] == 200, 60, "router serving tiny")

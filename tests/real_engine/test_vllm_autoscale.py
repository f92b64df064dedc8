"""Scale from zero with vLLM's CPU build (issue 25): a deployment with `autoscale` (min 0,
idle_to_zero) applied at zero replicas; one streamed request through the router is held,
wakes the deployment (the router tells the server at once), and gets its answer from the
vLLM engine that started for it; then, idle, it goes back to zero and the engine stops.

Reported (pytest -s): the first request's time to first token, the engine's own start
(apply of the count to the server showing the replica ready), and what the hold added
beyond it (ready to first token). One engine start; every process started here is
stopped at the end.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from fakes.engines import free_port
from fakes.live import Cluster, engine_pids, wait_for
from fakes.nvidia_smi import pcie_box
from fakes.vllm_rig import READY_TIMEOUT, node_copy, tiny_yaml, vllm_agent

pytestmark = pytest.mark.real_engine


@pytest.fixture
def cluster(make_cluster: Callable[..., Cluster]) -> Cluster:
    port = free_port()
    c = make_cluster(extra_server=f'metrics_bind = "127.0.0.1:{port}"\n')
    c.metrics_port = port  # type: ignore[attr-defined]
    return c


def _ready(cluster: Cluster) -> int:
    port = cluster.metrics_port  # type: ignore[attr-defined]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(r'^llmgw_server_replicas\{deployment="tiny",state="ready"\} (\S+)$', text, re.M)
    return int(float(m.group(1))) if m else 0


def _stream(port: int) -> dict[str, float | bool | bytes]:
    body = json.dumps({"model": "org/tiny", "prompt": "hello", "max_tokens": 4,
                       "stream": True}).encode()
    t0 = time.monotonic()
    first = 0.0
    with socket.create_connection(("127.0.0.1", port), timeout=READY_TIMEOUT) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
        buf = b""
        while not buf.endswith(b"0\r\n\r\n"):
            data = s.recv(65536)
            if not data:
                break
            buf += data
            if not first and b'"text"' in buf:
                first = time.monotonic()
    return {"ok": buf.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in buf, "t0": t0,
            "first": first, "body": buf[-400:]}


def test_vllm_scales_from_zero_for_a_held_request(
        cluster: Cluster, vllm_venv: Path, tiny_model: Path, tmp_path: Path) -> None:
    models = node_copy(tiny_model, tmp_path)
    cluster.up({"cpu-1": vllm_agent(vllm_venv, pcie_box(tmp_path / "smi"), models)})
    router, port = cluster.start_router(
        extra='load_report_interval = "500ms"\nfirst_byte_timeout = "120s"\n'
              f'cold_start_budget = "{READY_TIMEOUT}s"\n')
    router.wait_line("router listening", 20, "router start")

    cluster.apply("tiny", tiny_yaml(replicas=0, extra=(
        "drain_timeout: 10s\n"
        "autoscale: {min: 0, max: 1, in_flight_per_replica: 4, scale_up_after: 1s,\n"
        "            scale_down_after: 2s, idle_to_zero: 5s}\n")))
    time.sleep(2.5)  # the router's table lists it cold
    assert not engine_pids(tmp_path)

    ready_at: list[float] = []

    def watch() -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while not ready_at and time.monotonic() < deadline:
            if _ready(cluster) >= 1:
                ready_at.append(time.monotonic())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    got = _stream(port)
    watcher.join(timeout=30)
    assert got["ok"], (got, router.text()[-3000:])
    assert ready_at
    t0, first = float(got["t0"]), float(got["first"])
    events = cluster.ctl("describe", "deployment", "tiny").stdout
    assert "woken from zero" in events, events
    print(f"\nvLLM from zero: first token {first - t0:.1f}s after the request; the server "
          f"showed the replica ready {ready_at[0] - t0:.1f}s after it; the hold added "
          f"{first - ready_at[0]:.2f}s beyond that")

    # Idle: back to zero, the engine stopped.
    wait_for(lambda: not engine_pids(tmp_path), 90, "the engine stopped at zero", interval=0.5)
    assert "to zero" in cluster.ctl("describe", "deployment", "tiny").stdout

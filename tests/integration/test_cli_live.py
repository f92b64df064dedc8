"""The CLI against real processes: a dead server, a refused key and a wrong server key
each get their own one-line message and exit status, within the timeout; the agent says
the same; `describe node|replica`, `get KIND NAME`, `logs -n` and `logs -f`; a router
whose port is taken."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import trio

from fakes.live import LLMGW, Cluster, run_cli, wait_for
from fakes.nvidia_smi import pcie_box
from llmgw.errors import RequestFailedError
from llmgw.model.deployment import Deployment
from llmgw.model.engine import EngineKind
from llmgw.transport import keys
from llmgw.transport.client import request
from llmgw.transport.requests import ApplyOp

pytestmark = pytest.mark.slow


def _ctl(c: Cluster, key: str, server_key: str, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    r = run_cli("ctl", "--server", c.address, "--key", key, "--server-key", server_key, *args)
    return r, time.monotonic() - t0


def _one_line(r: subprocess.CompletedProcess[str]) -> str:
    err = r.stderr.strip()
    assert "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("llmgw: ") and "error: llmgw" not in err, err
    return err


def _other_keys(root: Path) -> Path:
    """A second keys folder: its admin key and server key mean nothing to the cluster."""
    other = root / "other-keys"
    keys.init_keys(str(other))
    keys.issue_key(str(other), "admin", "stranger")
    keys.issue_key(str(other), "node", "n1")
    return other


def test_dead_server_reported_within_the_timeout(cluster: Cluster) -> None:
    r, took = _ctl(cluster, cluster.admin_key, cluster.server_key, "--timeout", "2", "status")
    assert r.returncode == 4, r.stderr
    assert f"nothing answers at {cluster.address}" in _one_line(r)
    # 2 s of waiting plus the interpreter's start; nothing after the timeout.
    assert took < 2 + 2.5, f"took {took:.1f}s"


def test_refused_key_and_wrong_server_key_told_apart_at_once(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_server()
    other = _other_keys(tmp_path)
    r, took = _ctl(cluster, str(other / "stranger.key_secret"), cluster.server_key,
                   "--timeout", "20", "status")
    assert r.returncode == 3, r.stderr
    assert "refused this key" in _one_line(r)
    assert took < 5, f"a refused key took {took:.1f}s (timeout 20): should not wait for it"

    r, took = _ctl(cluster, cluster.admin_key, str(other / "server.key"), "--timeout", "20", "status")
    assert r.returncode == 3, r.stderr
    assert "wrong server_key" in _one_line(r)
    assert took < 5, f"a wrong server key took {took:.1f}s (timeout 20)"

    r, _ = _ctl(cluster, cluster.admin_key, cluster.server_key, "status")
    assert r.returncode == 0, r.stderr


def test_agent_that_never_reached_its_server_says_why(cluster: Cluster, tmp_path: Path) -> None:
    # No server yet: nothing answers.
    a = cluster.start_agent("n1")
    wait_for(lambda: "has not reached the server yet" in a.text(), 20, "the agent's first warning")
    assert f"nothing answers at {cluster.address}" in a.text()
    assert "lost the server" not in a.text()
    a.stop()
    # A server that does not know the agent's key.
    cluster.start_server()
    other = _other_keys(tmp_path)
    b = cluster.start_agent("n2", keys={"secret_key": str(other / "n1.key_secret"),
                                        "server_key": cluster.server_key})
    wait_for(lambda: "refused this key" in b.text(), 20, "the agent's refused-key warning")
    assert "has not reached the server yet" in b.text()


def test_describe_get_name_and_logs(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_server()
    cluster.start_agent("n1", discovery={"nvidia_smi": str(pcie_box(tmp_path / "smi"))})
    cluster.wait_states({"n1": "ready"})
    dep = tmp_path / "d.yaml"
    dep.write_text("name: demo\nmodel: llmgw/sim-tiny\nengine: simulated\ngpus_per_node: 1\n"
                   "replicas: 1\n")
    assert cluster.ctl("apply", "-f", str(dep)).returncode == 0

    def ready() -> bool:
        r = cluster.ctl("get", "replica", "demo-0", "-o", "json")
        return r.returncode == 0 and json.loads(r.stdout)["state"] == "ready"

    wait_for(ready, 40, "demo-0 ready", interval=0.5)

    for kind in ("deploy", "deployment", "deployments"):
        r = cluster.ctl("get", kind, "demo")
        assert r.returncode == 0 and "demo" in r.stdout, r.stderr
    r = cluster.ctl("-o", "json", "get", "no", "n1")  # -o before the verb
    assert r.returncode == 0 and json.loads(r.stdout)["id"] == "n1", r.stderr
    r = cluster.ctl("get", "node", "nope")
    assert r.returncode == 1 and "no node named 'nope'" in _one_line(r)

    r = cluster.ctl("describe", "node", "n1")
    assert r.returncode == 0, r.stderr
    assert "Node:      n1" in r.stdout and "demo-0" in r.stdout
    r = cluster.ctl("describe", "replica", "demo-0", "-o", "yaml")
    assert r.returncode == 0 and "deployment: demo" in r.stdout, r.stderr
    r = cluster.ctl("describe", "replica", "demo-0")
    assert r.returncode == 0 and "Replica:    demo-0" in r.stdout and "Events:" in r.stdout
    r = cluster.ctl("describe", "replica", "demo-9")
    assert r.returncode == 1 and "no replica named 'demo-9'" in _one_line(r)

    log = next((tmp_path / "agents" / "n1" / "work").rglob("engine.log"))
    with log.open("a") as f:
        f.write("".join(f"line {i}\n" for i in range(10)))
    r = cluster.ctl("logs", "demo-0", "-n", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1:] == ["line 7", "line 8", "line 9"]

    follow = subprocess.Popen(
        [*LLMGW, "ctl", "--server", cluster.address, "--key", cluster.admin_key,
         "--server-key", cluster.server_key, "logs", "demo-0", "-f", "-n", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2.5)
        with log.open("a") as f:
            f.write("after 1\nafter 2\n")
        time.sleep(2.5)
    finally:
        follow.send_signal(signal.SIGINT)
        out, err = follow.communicate(timeout=10)
    assert follow.returncode == 130, err
    assert "Traceback" not in err and err.strip() == "", err
    lines = out.splitlines()
    assert lines[1:] == ["line 8", "line 9", "after 1", "after 2"], out


def test_router_whose_port_is_taken(cluster: Cluster) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = cluster.router_config("r1", port)
        r = run_cli("router", "--config", str(cfg), timeout=20)
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in _one_line(r)


def test_server_whose_port_is_taken(cluster: Cluster) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", cluster.port))
        taken.listen()
        r = run_cli("server", "--config", str(cluster.server_toml), timeout=20)
    assert r.returncode == 2, r.stderr
    assert f"cannot bind {cluster.address}" in _one_line(r)


def test_apply_refuses_runtime_lora_with_several_vllm_api_servers(cluster: Cluster, tmp_path: Path) -> None:
    """vLLM exits at start when runtime LoRA updating meets api_server_count > 1: ctl says so
    before sending (exit 2), and the server refuses the same deployment sent by any client."""
    cluster.start_server()
    dep = tmp_path / "lora.yaml"
    dep.write_text("name: lora\nmodel: /models/llama\nengine: vllm\ngpus_per_node: 1\nreplicas: 1\n"
                   "max_loras: 2\nargs: [--data-parallel-size, '2']\n")
    r = cluster.ctl("apply", "-f", str(dep))
    assert r.returncode == 2 and "2 API server processes" in _one_line(r) and str(dep) in r.stderr
    op = ApplyOp(Deployment(name="lora", model="/models/llama", engine=EngineKind.VLLM, gpus_per_node=1,
                            replicas=1, max_loras=2, args=("--api-server-count", "2")))
    with pytest.raises(RequestFailedError, match="2 API server processes"):
        trio.run(request, cluster.address, cluster.admin_key, cluster.server_key, op, 10.0)
    assert "lora" not in cluster.ctl("get", "deployments").stdout

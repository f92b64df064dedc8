"""/metrics of a real server and a real agent, and the server's /status.json against
`ctl status -o json`, over real processes on loopback."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fakes.engines import free_port
from fakes.live import Cluster, run_cli, wait_for
from fakes.nvidia_smi import nvlink_board, uuid
from llmgw.transport import keys

pytestmark = pytest.mark.slow

TOKEN = "test-token-0123456789abcdef"


def get(url: str, token: str = "") -> tuple[int, str, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, tuple(sorted(labels.items()))))


def without_ages(doc: dict[str, Any]) -> dict[str, Any]:
    doc = json.loads(json.dumps(doc))
    for n in doc["nodes"]:
        n.pop("heartbeat_age")
    return doc


def test_server_and_agent_metrics(tmp_path: Path) -> None:
    server_port, agent_port = free_port(), free_port()
    c = Cluster(tmp_path, extra_server=f'metrics_bind = "127.0.0.1:{server_port}"\n'
                                       f'metrics_token = "{TOKEN}"\n')
    try:
        c.start_server()
        smi = nvlink_board(tmp_path / "smi")
        c.start_agent("n1", discovery={"nvidia_smi": str(smi)}, metrics_bind=f"127.0.0.1:{agent_port}")
        c.wait_states({"n1": "ready"})
        dep = tmp_path / "m.yaml"
        dep.write_text("name: m\nmodel: org/m\nengine: simulated\ngpus_per_node: 2\nreplicas: 1\n")
        assert c.ctl("apply", "-f", str(dep)).returncode == 0
        base = f"http://127.0.0.1:{server_port}"

        # Without the token: 401, for the metrics and the page's data alike.
        assert get(base + "/metrics")[0] == 401
        assert get(base + "/status.json")[0] == 401

        def server_text() -> str:
            status, ctype, text = get(base + "/metrics", TOKEN)
            assert status == 200 and ctype.startswith("text/plain"), (status, text)
            return text

        wait_for(lambda: value(server_text(), "llmgw_server_replicas", deployment="m", state="ready") == 1,
                 40, "the replica ready in the server's metrics")
        text = server_text()
        assert value(text, "llmgw_server_nodes", state="ready") == 1
        assert value(text, "llmgw_server_nodes", state="lost") == 0
        assert value(text, "llmgw_server_deployment_replicas_desired", deployment="m") == 1
        assert value(text, "llmgw_server_replicas", deployment="m", state="pending") == 0
        assert (value(text, "llmgw_server_messages_received_total", kind="hello") or 0) >= 1
        assert (value(text, "llmgw_server_messages_received_total", kind="heartbeat") or 0) >= 1
        assert (value(text, "llmgw_server_messages_sent_total", kind="welcome") or 0) >= 1
        assert (value(text, "llmgw_server_reconcile_pass_duration_seconds_count") or 0) >= 1
        assert (value(text, "llmgw_server_placement_duration_seconds_count") or 0) >= 1
        assert (value(text, "llmgw_server_replicas_placed_total") or 0) >= 1
        assert (value(text, "llmgw_server_store_write_duration_seconds_count", op="save_replicas") or 0) >= 1
        assert value(text, "process_resident_memory_bytes")

        # The status document is the one ctl prints.
        status, ctype, body = get(base + "/status.json", TOKEN)
        assert status == 200 and ctype == "application/json"
        assert without_ages(json.loads(body)) == without_ages(c.status())
        assert json.loads(body)["replicas"][0]["last_event"]["text"].startswith(("placed", "ready", "replica"))

        # A key the server does not know: a ZAP denial, counted.
        stray = tmp_path / "stray"
        keys.init_keys(str(stray))
        keys.issue_key(str(stray), "admin", "nobody")
        run_cli("ctl", "--server", c.address, "--key", str(stray / "nobody.key_secret"),
                "--server-key", c.server_key, "--timeout", "2", "status", timeout=30)
        wait_for(lambda: (value(server_text(), "llmgw_server_zap_denials_total", reason="unknown key") or 0) >= 1,
                 10, "the ZAP denial counted")

        agent = f"http://127.0.0.1:{agent_port}/metrics"

        def agent_text() -> str:
            status, _, text = get(agent)
            assert status == 200, text
            return text

        wait_for(lambda: value(agent_text(), "llmgw_agent_engines", state="ready") == 1, 20,
                 "the engine ready in the agent's metrics")
        text = agent_text()
        assert value(text, "llmgw_agent_engines", state="starting") == 0
        assert (value(text, "llmgw_agent_engine_starts_total") or 0) >= 1
        assert value(text, "llmgw_agent_engine_restarts_total") == 0
        assert (value(text, "llmgw_agent_health_probe_duration_seconds_count", result="ok") or 0) >= 1
        assert (value(text, "llmgw_agent_discovery_duration_seconds_count") or 0) >= 1
        assert value(text, "llmgw_agent_gpus") == 8
        # nvidia-smi (not NVML) here: memory from the last discovery, no utilisation.
        total = value(text, "llmgw_agent_gpu_memory_total_bytes", gpu="0", uuid=uuid(0))
        assert total and total > 0
        assert value(text, "llmgw_agent_gpu_memory_used_bytes", gpu="0", uuid=uuid(0)) is not None
        assert value(text, "llmgw_agent_gpu_utilization_ratio", gpu="0", uuid=uuid(0)) is None
    finally:
        c.close()

"""The agent's session with the server, with real processes, CURVE keys and sockets."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from fakes.engines import free_port
from fakes.live import Cluster, run_cli, wait_for
from llmgw.transport import keys


def test_agent_reaches_ready_and_ctl_shows_it(cluster: Cluster) -> None:
    cluster.start_server()
    cluster.start_agent("gpu-a-01", labels={"rack": "r12"})
    cluster.wait_states({"gpu-a-01": "ready"})
    node = cluster.status()["nodes"][0]
    assert node["mgmt_addr"] == "127.0.0.1"
    assert node["labels"] == {"rack": "r12"}
    assert node["fabrics"] == []
    table = cluster.ctl("status")
    assert table.returncode == 0
    assert "gpu-a-01" in table.stdout and "ready" in table.stdout


def test_spoofed_node_id_is_refused_and_the_claimed_node_not_marked_ready(cluster: Cluster) -> None:
    keys.issue_key(str(cluster.keys_dir), "node", "gpu-a-01")
    cluster.start_server()
    # A node key for gpu-a-01 in a config that claims to be gpu-a-02.
    spoof = cluster.start_agent("gpu-a-02", key_name="gpu-a-01")
    rc = spoof.wait(timeout=20)
    assert rc != 0
    assert "bound to node 'gpu-a-01'" in spoof.text()
    assert "gpu-a-02" not in cluster.node_states()


def test_unknown_key_never_completes_the_handshake(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_server()
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    import zmq.auth

    zmq.auth.create_certificates(stranger, "intruder", {"role": "admin", "identity": "ops"})
    r = run_cli("ctl", "--server", cluster.address, "--key", str(stranger / "intruder.key_secret"),
                "--server-key", cluster.server_key, "--timeout", "2", "status")
    # The server's ZAP handler refuses the key: identity refused (3), said at once.
    assert r.returncode == 3, r.stderr
    assert "not among the server's authorized keys" in r.stderr
    assert "Traceback" not in r.stderr


def test_revoked_key_is_cut_and_the_agent_exits_with_the_reason(cluster: Cluster) -> None:
    cluster.start_server()
    agent = cluster.start_agent("gpu-a-01")
    cluster.wait_states({"gpu-a-01": "ready"})
    r = run_cli("keys", "revoke", "gpu-a-01", "--dir", str(cluster.keys_dir))
    assert r.returncode == 0, r.stderr
    # Cut within one heartbeat (1 s) plus the server's folder poll (1 s).
    rc = agent.wait(timeout=5)
    assert rc == 3
    assert "revoked" in agent.text()


def test_node_key_cannot_make_admin_requests(cluster: Cluster) -> None:
    keys.issue_key(str(cluster.keys_dir), "node", "gpu-a-01")
    cluster.start_server()
    r = run_cli("ctl", "--server", cluster.address,
                "--key", str(cluster.keys_dir / "gpu-a-01.key_secret"),
                "--server-key", cluster.server_key, "status")
    assert r.returncode == 1
    assert "a node key may not ask for 'status'" in r.stderr


def test_router_key_can_only_read(cluster: Cluster) -> None:
    keys.issue_key(str(cluster.keys_dir), "router", "edge")
    cluster.start_server()
    args = ["ctl", "--server", cluster.address, "--key", str(cluster.keys_dir / "edge.key_secret"),
            "--server-key", cluster.server_key, "status"]
    r = run_cli(*args)
    assert r.returncode == 1
    assert "a router key may not ask for 'status'" in r.stderr


@pytest.mark.slow
def test_server_restart_agent_reconnects_by_itself(cluster: Cluster) -> None:
    server = cluster.start_server()
    agent = cluster.start_agent("gpu-a-01")
    cluster.wait_states({"gpu-a-01": "ready"})
    server.stop(signal.SIGKILL)
    cluster.procs.remove(server)
    cluster.start_server()
    cluster.wait_states({"gpu-a-01": "ready"}, timeout=30)
    assert agent.p.poll() is None
    assert "reconnecting" in agent.text() or "new Hello" in agent.text()


def test_sigterm_stops_agent_and_server_cleanly(cluster: Cluster) -> None:
    server = cluster.start_server()
    agent = cluster.start_agent("gpu-a-01")
    cluster.wait_states({"gpu-a-01": "ready"})
    assert agent.stop(signal.SIGTERM) == 0
    assert server.stop(signal.SIGINT) == 0
    assert "Traceback" not in agent.text() + server.text()


def test_ctl_unreachable_server_is_a_clear_error(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    r = run_cli(
        "ctl", "--server", c.address, "--key", c.admin_key, "--server-key", c.server_key,
        "--timeout", "1", "status")
    assert r.returncode == 4
    assert f"nothing answers at {c.address}" in r.stderr


def test_ctl_settings_from_environment(cluster: Cluster) -> None:
    cluster.start_server()
    r = run_cli("ctl", "status", "-o", "json", env={
        "LLMGW_SERVER": cluster.address, "LLMGW_CTL_KEY": cluster.admin_key,
        "LLMGW_SERVER_KEY": cluster.server_key, "XDG_CONFIG_HOME": str(cluster.root / "xdg")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("{")


def test_ctl_settings_missing_is_a_usage_error(tmp_path: Path) -> None:
    r = run_cli("ctl", "status", env={"XDG_CONFIG_HOME": str(tmp_path), "LLMGW_SERVER": "",
                                       "LLMGW_CTL_KEY": "", "LLMGW_SERVER_KEY": ""})
    assert r.returncode == 2
    assert "--server" in r.stderr and "LLMGW_SERVER" in r.stderr


def test_wait_for_helper_times_out() -> None:
    with pytest.raises(AssertionError, match="waiting for nothing"):
        wait_for(lambda: False, 0.2, "nothing")


def test_applied_deployment_survives_sigkill_of_the_server(cluster: Cluster, tmp_path: Path) -> None:
    server = cluster.start_server()
    f = tmp_path / "d.yaml"
    f.write_text("name: keep\nmodel: org/m\nengine: simulated\ngpus_per_node: 1\nreplicas: 3\n")
    r = cluster.ctl("apply", "-f", str(f))
    assert r.returncode == 0 and "created" in r.stdout
    server.stop(signal.SIGKILL)  # the moment ctl was told it succeeded
    cluster.procs.remove(server)
    cluster.start_server()
    got = cluster.ctl("get", "deployments", "-o", "json")
    assert got.returncode == 0, got.stderr
    (d,) = json.loads(got.stdout)
    assert (d["name"], d["replicas"]) == ("keep", 3)
    # Nothing fits (no nodes), and that is said, not refused.
    assert d["status"].startswith("unschedulable: ")


def test_bad_deployment_file_is_refused_before_sending(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_server()
    f = tmp_path / "bad.yaml"
    f.write_text("name: bad\nmodel: org/m\nengine: warp\ngpus_per_node: 0\nreplicas: 1\n")
    r = cluster.ctl("apply", "-f", str(f))
    assert r.returncode == 2
    assert str(f) in r.stderr and "Traceback" not in r.stderr
    assert json.loads(cluster.ctl("get", "deployments", "-o", "json").stdout) == []


def test_agent_moves_on_at_once_from_an_address_where_nothing_listens(tmp_path: Path) -> None:
    """A server list whose first address is dead (a failed-over leader): the Hello there is
    given up as soon as the connects are refused, not after its whole bound (3 heartbeat
    intervals, 15 s here), and the agent is welcomed at the next address."""
    c = Cluster(tmp_path, heartbeat="5s")
    try:
        c.start_server()
        dead = f"tcp://127.0.0.1:{free_port()}"
        agent = c.start_agent("gpu-a-01", server=[dead, c.address], heartbeat_interval="5s")
        c.wait_states({"gpu-a-01": "ready"}, timeout=10)
        assert f"nothing answers at {dead}" in agent.text()
    finally:
        c.close()

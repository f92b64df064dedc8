"""The KV relay's plumbing against a running server: an agent that advertises a relay gets
the router keys the server authorizes, right after Welcome and again each time `llmgw keys
issue` or `revoke` changes them; one that advertises none never gets them (an agent from
before the relay would log each as a bad message). A real agent's relay address reaches
`ctl status`."""

from __future__ import annotations

from fakes.engines import free_port
from fakes.hostile import RawPeer
from fakes.live import Cluster, run_cli
from llmgw import PROTOCOL_VERSION
from llmgw.model.inventory import Inventory, NodeInfo
from llmgw.transport.keys import issue_key, load_public
from llmgw.transport.messages import Hello, RouterKeys, Welcome

RELAY = "tcp://127.0.0.1:7444"  # advertised only: nothing needs to listen there


def _public(c: Cluster, name: str) -> str:
    return load_public(str(c.keys_dir / f"{name}.key")).decode()


def _hello(peer: RawPeer, node_id: str, relay: str) -> None:
    peer.send_msg(Hello(PROTOCOL_VERSION, NodeInfo(node_id, "127.0.0.1", kv_relay=relay), Inventory()))


def _router_keys(peer: RawPeer, timeout: float) -> RouterKeys | None:
    got: RouterKeys | None = peer.recv_until(lambda m: isinstance(m, RouterKeys), timeout)
    return got


def test_router_keys_follow_issue_and_revoke_to_relays_only(cluster: Cluster) -> None:
    for node in ("n1", "n2"):
        issue_key(str(cluster.keys_dir), "node", node)
    issue_key(str(cluster.keys_dir), "router", "ra")
    cluster.start_server()
    ra, relayed, plain = _public(cluster, "ra"), RawPeer(cluster.address, cluster.keys_dir / "n1.key_secret",
                                                         cluster.server_key), None
    try:
        plain = RawPeer(cluster.address, cluster.keys_dir / "n2.key_secret", cluster.server_key)
        _hello(relayed, "n1", RELAY)
        assert isinstance(relayed.recv_until(lambda m: isinstance(m, Welcome), 5), Welcome)
        first = _router_keys(relayed, 5)
        assert first == RouterKeys((ra,))
        _hello(plain, "n2", "")
        assert isinstance(plain.recv_until(lambda m: isinstance(m, Welcome), 5), Welcome)

        r = run_cli("keys", "issue", "router", "rb", "--dir", str(cluster.keys_dir))
        assert r.returncode == 0, r.stderr
        rb = _public(cluster, "rb")
        assert _router_keys(relayed, 10) == RouterKeys(tuple(sorted((ra, rb))))

        r = run_cli("keys", "revoke", "ra", "--dir", str(cluster.keys_dir))
        assert r.returncode == 0, r.stderr
        assert _router_keys(relayed, 10) == RouterKeys((rb,))
        # Both changes reached the relay's agent; the one without a relay got neither.
        assert _router_keys(plain, 0.5) is None
    finally:
        relayed.close()
        if plain is not None:
            plain.close()


def test_a_real_agent_advertises_its_relay_and_status_shows_it(cluster: Cluster) -> None:
    port = free_port()
    cluster.up({"n1": {"kv_relay_port": port}, "n2": {}})
    nodes = {n["id"]: n for n in cluster.status()["nodes"]}
    assert nodes["n1"]["kv_relay"] == f"tcp://127.0.0.1:{port}"
    assert nodes["n2"]["kv_relay"] == ""

"""The KV relay's plumbing against a running server: an agent that advertises a relay gets
the router keys the server authorizes, right after Welcome and again each time `llmgw keys
issue` or `revoke` changes them; one that advertises none never gets them (an agent from
before the relay would log each as a bad message). A real agent's relay address reaches
`ctl status`, and its relay lets in exactly the router keys the server authorizes now."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import zmq
import zmq.auth

from fakes.engines import free_port
from fakes.hostile import RawPeer
from fakes.live import Cluster, run_cli, wait_for
from llmgw import PROTOCOL_VERSION
from llmgw.kvcache import relay_wire
from llmgw.model.inventory import Inventory, NodeInfo
from llmgw.transport.keys import issue_key, load_pair, load_public
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


class _Follower:
    """A router's side of one agent relay, blocking: a CURVE DEALER with a router key."""

    def __init__(self, endpoint: str, secret: Path, relay_key: bytes) -> None:
        pair = load_pair(str(secret))
        self.ctx: zmq.Context[Any] = zmq.Context()
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.curve_secretkey, s.curve_publickey, s.curve_serverkey = pair.secret_key, pair.public_key, relay_key
        s.connect(endpoint)
        self.sock = s

    def answered(self, timeout: float = 1.0) -> bool:
        """A Follow for a replica the agent has no stream of: its Gone, or nothing."""
        self.sock.send_multipart(relay_wire.encode(relay_wire.Follow({"r-none": None})),
                                 flags=zmq.NOBLOCK)
        if not self.sock.poll(int(timeout * 1000), zmq.POLLIN):
            return False
        return relay_wire.decode(self.sock.recv_multipart()) == relay_wire.Gone("r-none")

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _answered_fresh(endpoint: str, secret: Path, relay_key: bytes) -> bool:
    # A fresh connection each try: one refused by the relay's ZAP stays refused.
    f = _Follower(endpoint, secret, relay_key)
    try:
        return f.answered()
    finally:
        f.close()


def test_a_real_agents_relay_lets_in_exactly_the_routers_the_server_authorizes(cluster: Cluster) -> None:
    issue_key(str(cluster.keys_dir), "router", "ra")
    port = free_port()
    cluster.up({"n1": {"kv_relay_port": port}})
    endpoint, relay_key = f"tcp://127.0.0.1:{port}", load_public(str(cluster.keys_dir / "n1.key"))
    ra = _Follower(endpoint, cluster.keys_dir / "ra.key_secret", relay_key)
    try:
        wait_for(ra.answered, 10, "the relay to answer router ra")
        # A router key the server never issued: the relay's ZAP refuses it.
        strangers = cluster.root / "strangers"
        strangers.mkdir()
        stranger = Path(zmq.auth.create_certificates(str(strangers), "rx")[1])
        assert not _answered_fresh(endpoint, stranger, relay_key)
        # Issued now: let in once the server has told the agent (no restart of anything).
        r = run_cli("keys", "issue", "router", "rb", "--dir", str(cluster.keys_dir))
        assert r.returncode == 0, r.stderr
        wait_for(lambda: _answered_fresh(endpoint, cluster.keys_dir / "rb.key_secret", relay_key), 15,
                 "the relay to let in router rb, issued a moment ago")
        # Revoked: its open connection is answered no more.
        r = run_cli("keys", "revoke", "ra", "--dir", str(cluster.keys_dir))
        assert r.returncode == 0, r.stderr
        wait_for(lambda: not ra.answered(0.5), 15, "the relay to stop answering revoked router ra")
    finally:
        ra.close()

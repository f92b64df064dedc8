"""A real agent's KV relay, end to end: the agent (its own process) listens on its
kv_relay_port with its node key; a router key the server authorized follows and is
answered (Gone: no engine of that replica here), a key never issued is refused at the
handshake, and a router key revoked with `llmgw keys revoke` is refused from then on."""

from __future__ import annotations

from typing import Any

import zmq

from fakes.engines import free_port
from fakes.live import Cluster, run_cli, wait_for
from llmgw.kvcache.relay_wire import Follow, Gone, decode, encode
from llmgw.transport.keys import issue_key, load_pair, load_public


def _dealer(ctx: zmq.Context[Any], c: Cluster, secret_file: str, node: str,
            endpoint: str) -> zmq.Socket[Any]:
    pair = load_pair(secret_file)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_secretkey, sock.curve_publickey = pair.secret_key, pair.public_key
    sock.curve_serverkey = load_public(str(c.keys_dir / f"{node}.key"))  # the relay's key
    sock.connect(endpoint)
    return sock


def _answer(sock: zmq.Socket[Any], timeout_ms: int) -> object | None:
    """Send a Follow of a replica not here; the relay's answer, or None in time."""
    sock.send_multipart(encode(Follow({"not-here-0": None})))
    if not sock.poll(timeout_ms):
        return None
    return decode(sock.recv_multipart())


def _refused(sock: zmq.Socket[Any], timeout_ms: int) -> bool:
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        sock.send_multipart(encode(Follow({})))
        return bool(mon.poll(timeout_ms))
    finally:
        sock.disable_monitor()
        mon.close()


def test_routers_the_server_authorizes_follow_a_real_agents_relay(cluster: Cluster) -> None:
    issue_key(str(cluster.keys_dir), "router", "ra")
    issue_key(str(cluster.keys_dir), "router", "rb")
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    cluster.up({"n1": {"kv_relay_port": port}})
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        ra = _dealer(ctx, cluster, str(cluster.keys_dir / "ra.key_secret"), "n1", endpoint)
        # The router keys reach the agent right after its Welcome: asked until they have.
        got = wait_for(lambda: _answer(ra, 500), 20, "the relay's answer to router ra")
        assert got == Gone("not-here-0")

        stranger = ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        public, secret = zmq.curve_keypair()
        stranger.curve_secretkey, stranger.curve_publickey = secret, public
        stranger.curve_serverkey = load_public(str(cluster.keys_dir / "n1.key"))
        stranger.connect(endpoint)
        assert _refused(stranger, 10_000)
        stranger.close()

        r = run_cli("keys", "revoke", "rb", "--dir", str(cluster.keys_dir))
        assert r.returncode == 0, r.stderr

        def rb_refused() -> bool:
            rb = _dealer(ctx, cluster, str(cluster.keys_dir / "rb.key_secret"), "n1", endpoint)
            try:
                return _refused(rb, 1000)
            finally:
                rb.close()

        wait_for(rb_refused, 20, "router rb refused once revoked")
        assert _answer(ra, 10_000) == Gone("not-here-0")  # ra is still let in
        ra.close()
    finally:
        ctx.destroy(linger=0)

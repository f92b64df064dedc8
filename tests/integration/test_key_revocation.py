"""`llmgw keys revoke` against a running server: identity is the key, not the name.

- Once `llmgw keys revoke NAME` has returned, an admin's or router's very next request is
  refused, on a connection that was already open and on a new one; a node's session is
  cut within one heartbeat.
- `llmgw keys issue ROLE NAME` after a revoke makes a new key under the old name: the new
  key works, the old one never gets back in (issue 9, items 2 and 7).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from fakes.hostile import RawPeer
from fakes.live import Cluster, run_cli, wait_for
from llmgw.transport.keys import issue_key
from llmgw.transport.messages import Heartbeat, HeartbeatAck, Refused, Welcome

OPS = {"admin": "status", "router": "endpoints"}


def _keys(c: Cluster, *args: str) -> None:
    r = run_cli("keys", *args, "--dir", str(c.keys_dir))
    assert r.returncode == 0, r.stderr


def _peer(c: Cluster, secret: Path | str) -> RawPeer:
    return RawPeer(c.address, secret, c.server_key)


def _fresh_request(c: Cluster, secret: Path | str, op: str, timeout: float = 2.0) -> str:
    with _peer(c, secret) as p:
        return p.request(op, timeout=timeout)


def _keep_old_secret(c: Cluster, name: str) -> Path:
    """`keys issue` writes the new pair over NAME.key_secret: keep the old one aside."""
    old = c.root / f"old-{name}.key_secret"
    shutil.copy(c.keys_dir / f"{name}.key_secret", old)
    return old


def _node(c: Cluster, node_id: str) -> dict[str, object] | None:
    return next((n for n in c.status()["nodes"] if n["id"] == node_id), None)


@pytest.mark.parametrize("role", ["admin", "router"])
def test_revoke_refuses_the_very_next_request(cluster: Cluster, role: str) -> None:
    """Item 7: no grace period after `keys revoke` returns, old connection or new."""
    names = [f"{role}-{i}" for i in range(2)]
    for name in names:
        issue_key(str(cluster.keys_dir), role, name)
    server = cluster.start_server()
    op = OPS[role]
    for name in names:
        secret = cluster.keys_dir / f"{name}.key_secret"
        with _peer(cluster, secret) as conn:
            assert conn.request(op) == "ok"
            _keys(cluster, "revoke", name)
            on_open = conn.request(op, timeout=2)
        on_new = _fresh_request(cluster, secret, op)
        assert "ok" not in (on_open, on_new), (
            f"{role} key {name!r} still served right after `keys revoke` returned: "
            f"open connection {on_open}, new connection {on_new}")
    assert server.p.poll() is None
    assert cluster.ctl("status").returncode == 0


def test_revoked_node_session_is_cut_within_a_heartbeat(cluster: Cluster) -> None:
    issue_key(str(cluster.keys_dir), "node", "n1")
    cluster.start_server()
    with _peer(cluster, cluster.keys_dir / "n1.key_secret") as conn:
        assert isinstance(conn.hello("n1"), Welcome)
        _keys(cluster, "revoke", "n1")
        revoked_at = time.monotonic()
        # Unprompted, or in answer to the next heartbeat: the session is refused.
        got = None
        for seq in range(4):
            conn.send_msg(Heartbeat(seq))
            got = conn.recv_until(lambda m: isinstance(m, Refused), 0.5)
            if got is not None:
                break
        cut_after = time.monotonic() - revoked_at
        assert got is not None, "a revoked node's heartbeats were still taken 2 s after revoke"
        assert cut_after < 1.5, f"a revoked node's session lasted {cut_after:.1f}s (heartbeat 1s)"
    wait_for(lambda: (_node(cluster, "n1") or {}).get("connected") is False, 5, "n1 shown disconnected")


def test_reissued_node_key_does_not_readmit_the_old_key(cluster: Cluster) -> None:
    """Item 2: revoke n1, issue a new key named n1; the old key stays out, the new works."""
    issue_key(str(cluster.keys_dir), "node", "n1")
    server = cluster.start_server()
    old_secret = _keep_old_secret(cluster, "n1")
    with _peer(cluster, old_secret) as old:
        assert isinstance(old.hello("n1"), Welcome)
        _keys(cluster, "revoke", "n1")
        assert old.recv_until(lambda m: isinstance(m, Refused), 3) is not None, "old session not cut"
        wait_for(lambda: (_node(cluster, "n1") or {}).get("connected") is False, 5, "n1 disconnected")

        _keys(cluster, "issue", "node", "n1")
        new_secret = cluster.keys_dir / "n1.key_secret"
        assert new_secret.read_bytes() != old_secret.read_bytes()

        def new_key_welcomed() -> RawPeer | None:
            p = _peer(cluster, new_secret)
            if isinstance(p.hello("n1", timeout=1), Welcome):
                return p
            p.close()
            return None

        new = wait_for(new_key_welcomed, 10, "the re-issued n1 key to be welcomed", interval=0.2)
        try:
            # The old key, on its old connection and on a new one, is not n1 any more.
            again = old.hello("n1", timeout=3)
            assert not isinstance(again, Welcome), "the revoked n1 key was welcomed again after re-issue"
            with _peer(cluster, old_secret) as fresh:
                assert not isinstance(fresh.hello("n1", timeout=3), Welcome), (
                    "a new connection with the revoked n1 key was welcomed after re-issue")
            # The new key's session is the one that counts, and it is still served.
            new.send_msg(Heartbeat(7))
            ack = new.recv_until(lambda m: isinstance(m, HeartbeatAck | Refused), 3)
            assert isinstance(ack, HeartbeatAck) and ack.seq == 7, ack
            assert (_node(cluster, "n1") or {}).get("connected") is True
        finally:
            new.close()
    assert server.p.poll() is None


@pytest.mark.parametrize("role", ["admin", "router"])
def test_reissued_admin_or_router_key_does_not_readmit_the_old_key(cluster: Cluster, role: str) -> None:
    name = f"{role}-x"
    op = OPS[role]
    issue_key(str(cluster.keys_dir), role, name)
    server = cluster.start_server()
    old_secret = _keep_old_secret(cluster, name)
    with _peer(cluster, old_secret) as old:
        assert old.request(op) == "ok"
        _keys(cluster, "revoke", name)
        wait_for(lambda: old.request(op, timeout=1) != "ok", 5, f"revoked {role} key refused")
        _keys(cluster, "issue", role, name)
        new_secret = cluster.keys_dir / f"{name}.key_secret"
        wait_for(lambda: _fresh_request(cluster, new_secret, op, timeout=1) == "ok", 10,
                 f"the re-issued {role} key to be served", interval=0.2)
        on_old = old.request(op, timeout=2)
        assert on_old != "ok", f"the revoked {role} key was served again on its open connection"
    on_fresh = _fresh_request(cluster, old_secret, op)
    assert on_fresh != "ok", f"a new connection with the revoked {role} key was served after re-issue"
    assert _fresh_request(cluster, new_secret, op) == "ok"
    assert server.p.poll() is None

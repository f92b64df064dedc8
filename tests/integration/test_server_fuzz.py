"""Hypothesis-generated hostile frames from authorized peers against a real server.

Whatever an authorized node or router key sends — garbage, truncated or mutated
messages, unhashable kinds, deep nesting, server-only kinds, over-size frames,
multipart junk, floods — the server stays up, keeps serving the real agent next to it,
stores nothing of it, and keeps its memory and its log bounded.

LLMGW_FUZZ_FRAMES (default 10000) sets how many frames the fuzz sends;
LLMGW_FUZZ_SEED makes a run repeatable (the seed used is printed on failure).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from fakes.hostile import RawPeer, hostile_sends, longest_line, rss_kib
from fakes.live import Cluster, Proc
from llmgw.transport.keys import issue_key

MAX_MESSAGE_SIZE = 256 * 1024
FRAMES = int(os.environ.get("LLMGW_FUZZ_FRAMES", "10000"))
REAL = "gpu-a-01"
MAX_LINE = 4096  # bytes: a log line with peer text is cut at ~2 KiB
MAX_LOG_GROWTH = 1024 * 1024
MAX_RSS_GROWTH_KIB = 16 * 1024
ATTACKERS = {"evil": "node", "mute": "node", "rtr-evil": "router"}


@pytest.fixture
def bounded_cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, extra_server=f"max_message_size = {MAX_MESSAGE_SIZE}\n")
    # Issued before the server starts, so that it knows them from the first handshake.
    for name, role in ATTACKERS.items():
        issue_key(str(c.keys_dir), role, name)
    try:
        yield c
    finally:
        c.close()


def _peer(c: Cluster, name: str) -> RawPeer:
    return RawPeer(c.address, c.keys_dir / f"{name}.key_secret", c.server_key)


def _alive(server: Proc, what: str) -> None:
    if server.p.poll() is not None:
        tail = server.text()[-3000:]
        raise AssertionError(f"server exited with {server.p.returncode} {what}; log tail:\n{tail}")


def _real_node(status: dict[str, Any]) -> dict[str, Any]:
    [node] = [n for n in status["nodes"] if n["id"] == REAL]
    return {k: v for k, v in node.items() if k != "heartbeat_age"}


def _replica_ids(c: Cluster) -> set[str]:
    r = c.ctl("get", "replicas", "-o", "json")
    assert r.returncode == 0, r.stderr
    return {row["id"] for row in json.loads(r.stdout)}


def test_unhashable_and_odd_kinds_leave_the_server_up(bounded_cluster: Cluster) -> None:
    """Issue 9, item 1: `{"kind": []}` and friends from a node or a router key once took
    the server down (TypeError: unhashable, in the codec)."""
    c = bounded_cluster
    server = c.start_server()
    with _peer(c, "evil") as node, _peer(c, "rtr-evil") as router:
        assert router.request("endpoints") == "ok"
        for kind in ([], {}, 1, None, b"hello", [1, 2], {"a": []}, 1.5, True):
            frame = msgpack.packb({"kind": kind}, use_bin_type=True)
            for peer, who in ((node, "node"), (router, "router")):
                peer.send(frame)
                # The router's next request is answered only if the frame did not kill it.
                answer = router.request("endpoints", timeout=5)
                _alive(server, f"after {who} key sent {{'kind': {kind!r}}}")
                assert answer == "ok", f"router not answered after {who} sent kind {kind!r}"
    assert c.status()["nodes"] == []
    _alive(server, "at the end")


@pytest.mark.slow
def test_fuzzed_frames_change_nothing_and_stay_bounded(bounded_cluster: Cluster) -> None:
    c = bounded_cluster
    server = c.start_server()
    c.start_agent(REAL)
    c.wait_states({REAL: "ready"})
    node, mute, router = _peer(c, "evil"), _peer(c, "mute"), _peer(c, "rtr-evil")
    peers = [node, mute, router]
    try:
        welcome = node.hello("evil")
        assert type(welcome).__name__ == "Welcome", welcome
        before = c.status()
        replicas_before = _replica_ids(c)
        rss_before = rss_kib(server.pid)
        log_before = c.root.joinpath("server.log").stat().st_size

        base_seed = int(os.environ.get("LLMGW_FUZZ_SEED") or random.randrange(2**32))
        print(f"LLMGW_FUZZ_SEED={base_seed} LLMGW_FUZZ_FRAMES={FRAMES}")
        sent = Counter[str]()
        total = 0
        samples: list[str] = []
        next_sample = FRAMES // 5
        started = time.monotonic()

        sends = st.lists(st.tuples(st.integers(0, len(peers) - 1),
                                   hostile_sends([REAL, "evil", "rtr-evil"], MAX_MESSAGE_SIZE)),
                         min_size=1, max_size=20)

        def fuzz_once(batch: list[Any]) -> None:
            nonlocal total, next_sample
            _alive(server, f"after {total} fuzzed frames ({dict(sent)})")
            for who, item in batch:
                for _ in range(item.repeat):
                    peers[who].send(*item.frames)
                sent[item.category] += item.repeat
                total += item.repeat
            for p in peers:
                p.drain()
            if total >= next_sample:
                next_sample += FRAMES // 5
                _alive(server, f"after {total} fuzzed frames ({dict(sent)})")
                states = c.node_states()
                samples.append(states.get(REAL, "missing"))
                assert states.get(REAL) == "ready", f"{REAL} is {states.get(REAL)} after {total} frames"

        rounds = 0
        while total < FRAMES:
            _alive(server, f"after {total} fuzzed frames ({dict(sent)})")
            run = settings(max_examples=max(10, (FRAMES - total) // 60), deadline=None, database=None,
                           phases=[Phase.generate], suppress_health_check=list(HealthCheck))(
                given(sends)(fuzz_once))
            hypothesis_seed(base_seed + rounds)(run)()
            rounds += 1

        # Each peer's queue is handled in order: an answer to a last message means the
        # server has been through everything that peer sent.
        assert node.welcomed("evil", timeout=30)
        assert router.request("endpoints", timeout=20) == "ok"
        fuzz_s = time.monotonic() - started
        _alive(server, f"after all {total} fuzzed frames")
        after = c.status()
        replicas_after = _replica_ids(c)
        rss_after = rss_kib(server.pid)
    finally:
        for p in peers:
            p.close()

    assert _real_node(after) == _real_node(before)
    assert _real_node(after)["state"] == "ready"
    assert {n["id"] for n in after["nodes"]} <= {REAL, "evil"}
    for key in ("deployments", "replicas"):
        assert after.get(key) == before.get(key), key
    assert replicas_after == replicas_before
    assert not any("forged" in json.dumps(r) for r in after.get("replicas", []))
    assert rss_after - rss_before < MAX_RSS_GROWTH_KIB, (
        f"server RSS grew {(rss_after - rss_before) / 1024:.1f} MiB over {total} frames")
    log = c.root / "server.log"
    growth = log.stat().st_size - log_before
    longest, head = longest_line(log, log_before)
    print(f"sent {total} frames in {fuzz_s:.1f}s: {dict(sent)}; status samples {samples}; "
          f"server RSS {rss_before} -> {rss_after} KiB; log +{growth} bytes, longest line {longest}")
    assert longest <= MAX_LINE, f"a {longest}-byte log line: {head!r}…"
    assert growth < MAX_LOG_GROWTH, f"the server log grew {growth} bytes over {total} frames"
    assert "Traceback" not in server.text()

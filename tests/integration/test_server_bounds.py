"""What one authorized peer can make a real server keep or write is bounded (issue 9,
items 4 and 5).

- Engine reports for replica ids that are neither in the node's desired set nor among
  the engines it reported at Hello are refused and not stored; log tails are capped.
- Every log line with peer text is cut (~2 KiB), and repeated warnings about one peer
  are rate-limited, so neither one Hello nor ten thousand bad frames flood the log.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from fakes.hostile import RawPeer, deep_in_kind, engine_report, hello_msg, longest_line, rss_kib
from fakes.live import Cluster
from llmgw.transport import codec
from llmgw.transport.keys import issue_key
from llmgw.transport.messages import EngineChanged, Heartbeat, HeartbeatAck, HelloFirst, Welcome

REPORTS = 10_000
TAIL = 8 * 1024  # bytes of log tail in each made-up report
CHUNK = 500  # reports sent between two round trips, so no queue grows in between
MAX_RSS_GROWTH_KIB = 8 * 1024
MAX_LINE = 4096
MAX_LOG_GROWTH = 1024 * 1024


@pytest.fixture
def liar_cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    for name in ("liar", "loud"):
        issue_key(str(c.keys_dir), "node", name)
    try:
        yield c
    finally:
        c.close()


def _round_trip(peer: RawPeer, seq: int, timeout: float = 30) -> None:
    """Everything `peer` sent before has been handled once this returns (one connection's
    messages are handled in order). A peer without a session gets HelloFirst instead; the
    Refused answers to earlier messages are passed over."""
    peer.send_msg(Heartbeat(seq))
    got = peer.recv_until(lambda m: (isinstance(m, HeartbeatAck) and m.seq == seq)
                          or isinstance(m, HelloFirst), timeout)
    assert got is not None, f"no answer to heartbeat {seq} within {timeout}s"


def test_made_up_replica_reports_are_not_stored(liar_cluster: Cluster) -> None:
    c = liar_cluster
    server = c.start_server()
    known = engine_report("liar-known-0", 0)
    with RawPeer(c.address, c.keys_dir / "liar.key_secret", c.server_key) as liar:
        assert isinstance(liar.hello("liar", engines=[known]), Welcome)
        # Warm up whatever the server allocates once (buffers, caches), then measure.
        seq = 0
        for i in range(CHUNK):
            liar.send_msg(EngineChanged(engine_report(f"warmup-{i}", TAIL)))
        _round_trip(liar, seq)
        rss_before = rss_kib(server.pid)
        for start in range(0, REPORTS, CHUNK):
            for i in range(start, start + CHUNK):
                liar.send_msg(EngineChanged(engine_report(f"made-up-{i:05d}", TAIL)))
            seq += 1
            _round_trip(liar, seq)
            assert server.p.poll() is None, server.text()[-3000:]
        rss_after = rss_kib(server.pid)
        status = c.status()
        r = c.ctl("get", "replicas", "-o", "json")
        assert r.returncode == 0, r.stderr
    assert server.p.poll() is None
    growth = rss_after - rss_before
    assert growth < MAX_RSS_GROWTH_KIB, (
        f"server RSS grew {growth / 1024:.1f} MiB after {REPORTS} made-up engine reports "
        f"with {TAIL // 1024} KiB log tails")
    shown = json.dumps(status) + r.stdout
    assert "made-up-" not in shown and "warmup-" not in shown
    assert [n["id"] for n in status["nodes"]] == ["liar"]


def _loud_frames(n: int) -> Iterator[list[bytes]]:
    """n bad messages, a few of them large, each of a kind that is logged today."""
    raw = msgpack.unpackb(codec.encode(hello_msg("loud")), raw=False)
    raw["inventory"]["gpus"] = list(range(2000))
    big_gpus = msgpack.packb(raw, use_bin_type=True)
    long_id = codec.encode(hello_msg("x" * 100_000))
    long_kind = msgpack.packb({"kind": "k" * 100_000}, use_bin_type=True)
    long_text = msgpack.packb("t" * 100_000, use_bin_type=True)
    bad_type = msgpack.packb({"kind": "heartbeat", "seq": "s" * 100_000}, use_bin_type=True)
    big = [big_gpus, long_id, long_kind, long_text, bad_type, deep_in_kind(1000)]
    small = [os.urandom(48), b"\xc1", msgpack.packb({"kind": "launch"}), msgpack.packb([1, 2]),
             codec.encode(hello_msg("someone-else")), msgpack.packb({"kind": "heartbeat", "seq": "x"})]
    for i in range(n):
        if i % 100 < len(big):
            yield [big[i % 100]]
        elif i % 50 == 7:
            yield [b"multi", b"part", os.urandom(8)]
        else:
            yield [small[i % len(small)]]


def test_hostile_input_cannot_flood_the_log(liar_cluster: Cluster) -> None:
    c = liar_cluster
    server = c.start_server()
    log = c.root / "server.log"
    with RawPeer(c.address, c.keys_dir / "loud.key_secret", c.server_key) as loud:
        # One Hello of a few KB with 2000 "GPUs" of the wrong type: one 889 kB line today.
        raw = msgpack.unpackb(codec.encode(hello_msg("loud")), raw=False)
        raw["inventory"]["gpus"] = list(range(2000))
        start = log.stat().st_size
        loud.send(msgpack.packb(raw, use_bin_type=True))
        _round_trip(loud, 0)
        longest, head = longest_line(log, start)
        assert longest <= MAX_LINE, f"one bad Hello wrote a {longest}-byte log line: {head!r}…"

        # Ten thousand bad frames, a hundred of them large.
        start = log.stat().st_size
        for i, frames in enumerate(_loud_frames(10_000)):
            loud.send(*frames)
            if i % 1000 == 999:
                _round_trip(loud, i)
                loud.drain()
        _round_trip(loud, 10_000)
        assert isinstance(loud.hello("loud"), Welcome)
    assert server.p.poll() is None
    assert c.ctl("status").returncode == 0
    growth = log.stat().st_size - start
    longest, head = longest_line(log, start)
    assert longest <= MAX_LINE, f"a {longest}-byte log line: {head!r}…"
    assert growth < MAX_LOG_GROWTH, f"10,000 bad frames from one peer wrote {growth} bytes of log"

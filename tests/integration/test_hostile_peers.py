"""An authenticated peer that sends garbage cannot take the server down or change what it
stores; the other peers keep being answered."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import zmq

from fakes.live import Cluster
from llmgw import PROTOCOL_VERSION
from llmgw.model.inventory import Inventory, NodeInfo
from llmgw.transport import codec
from llmgw.transport.dealer import connect
from llmgw.transport.keys import issue_key, load_pair, load_public
from llmgw.transport.messages import Hello, Refused


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, extra_server="max_message_size = 65536\n")
    try:
        yield c
    finally:
        c.close()


def _stable(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in n.items() if k != "heartbeat_age"} for n in status["nodes"]]


async def test_garbage_and_floods_change_nothing(cluster: Cluster) -> None:
    issue_key(str(cluster.keys_dir), "node", "evil")
    server = cluster.start_server()
    cluster.start_agent("gpu-a-01")
    await trio.to_thread.run_sync(lambda: cluster.wait_states({"gpu-a-01": "ready"}))
    before = await trio.to_thread.run_sync(cluster.status)

    pair = load_pair(str(cluster.keys_dir / "evil.key_secret"))
    server_public = load_public(cluster.server_key)
    ctx: zmq.Context[Any] = zmq.Context()
    refusals = 0
    try:
        async with connect(ctx, cluster.address, pair, server_public) as conn:
            junk = [
                os.urandom(64),
                codec.encode(Hello(PROTOCOL_VERSION, NodeInfo("evil", "1.1.1.1"), Inventory()))[:-3],
                msgpack.packb({"kind": "launch_missiles", "target": "gpu-a-01"}),
                msgpack.packb({"kind": "heartbeat", "seq": "x" * 1000}),
                msgpack.packb({"kind": "desired_set", "generation": 1, "engines": []}),
                b"",
            ]
            for payload in junk:
                await conn.send(payload)
            await conn.sock.send_multipart([b"two", b"frames"])
            # A flood of Hellos that claim somebody else's node.
            spoof = codec.encode(Hello(PROTOCOL_VERSION, NodeInfo("gpu-a-01", "6.6.6.6"), Inventory()))
            for _ in range(2000):
                await conn.send(spoof)
            with trio.fail_after(20):
                while refusals < 2000:
                    if isinstance(codec.decode(await conn.recv()), Refused):
                        refusals += 1
        # Over the size limit: the server cuts the connection, nothing more.
        async with connect(ctx, cluster.address, pair, server_public) as conn:
            await conn.send(b"x" * 200_000)
            await trio.sleep(0.5)
    finally:
        ctx.destroy(linger=0)

    assert refusals == 2000
    after = await trio.to_thread.run_sync(cluster.status)
    assert server.p.poll() is None
    assert _stable(after) == _stable(before)
    assert [n["id"] for n in after["nodes"]] == ["gpu-a-01"]
    assert after["nodes"][0]["mgmt_addr"] == "127.0.0.1"
    assert "Traceback" not in server.text()

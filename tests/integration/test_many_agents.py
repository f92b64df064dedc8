"""Fifty agents' links in one process, each with its own DEALER socket and key."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
import zmq

from fakes.live import Cluster
from llmgw import PROTOCOL_VERSION
from llmgw.agent.link import Connection, LinkHooks, LinkSettings, serve_link
from llmgw.model.inventory import Inventory, NodeInfo
from llmgw.transport import dealer
from llmgw.transport.keys import issue_key, load_pair, load_public
from llmgw.transport.messages import DesiredSet, Hello, Message

N = 50


async def test_fifty_agents_reach_ready(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    names = [f"sim-{i:03d}" for i in range(N)]
    for name in names:
        issue_key(str(cluster.keys_dir), "node", name)
    cluster.start_server()
    server_public = load_public(cluster.server_key)
    ctx: zmq.Context[Any] = zmq.Context()
    settings = LinkSettings(heartbeat_interval=1.0, reconnect_base=0.2, reconnect_max=2.0)

    def agent(name: str) -> Any:
        pair = load_pair(str(cluster.keys_dir / f"{name}.key_secret"))

        @asynccontextmanager
        async def connect() -> AsyncIterator[Connection]:
            async with dealer.connect(ctx, cluster.address, pair, server_public) as c:
                yield c

        async def on_desired(_: DesiredSet) -> None:
            return None

        hooks = LinkHooks(
            hello=lambda: Hello(PROTOCOL_VERSION, NodeInfo(name, "127.0.0.1"), Inventory()),
            on_desired=on_desired,
        )
        _, outbox = trio.open_memory_channel[Message](1)
        return serve_link, settings, connect, hooks, outbox

    try:
        async with trio.open_nursery() as nursery:
            for name in names:
                nursery.start_soon(*agent(name))

            def all_ready() -> bool:
                states = cluster.node_states()
                return len(states) == N and set(states.values()) == {"ready"}

            with trio.fail_after(60):
                while not await trio.to_thread.run_sync(all_ready):
                    await trio.sleep(0.5)
            # And they stay ready over several heartbeats.
            await trio.sleep(3)
            assert await trio.to_thread.run_sync(all_ready)
            nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)
        cluster.close()

"""`llmgw server`: the control plane as the CLI runs it."""

from __future__ import annotations

import trio

from llmgw.config.server import ServerConfig
from llmgw.rlimit import raise_nofile
from llmgw.server.peers.service import serve_server


async def run_server(config: ServerConfig) -> None:
    async with trio.open_nursery() as nursery:
        if config.store.url:  # PostgreSQL: one of several servers, leader or standby
            from llmgw.server.store.leadership import serve_replicated

            await nursery.start(serve_replicated, config)
        else:
            await nursery.start(serve_server, config)
        # Once bound, so that a server that cannot bind says only that; before any number
        # of peers could need it. One descriptor per peer socket: a shell's 1024 is few.
        raise_nofile("server")

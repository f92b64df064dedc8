"""`llmgw server`: the control plane as the CLI runs it."""

from __future__ import annotations

from llmgw.config.server import ServerConfig
from llmgw.rlimit import raise_nofile
from llmgw.server.service import serve_server


async def run_server(config: ServerConfig) -> None:
    raise_nofile("server")  # one descriptor per peer socket; a shell's 1024 is too few
    if config.store.url:  # PostgreSQL: one of several servers, leader or standby
        from llmgw.server.ha import serve_replicated

        await serve_replicated(config)
    else:
        await serve_server(config)

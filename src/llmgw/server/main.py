"""`llmgw server`: the control plane as the CLI runs it."""

from __future__ import annotations

from llmgw.config.server import ServerConfig
from llmgw.server.service import serve_server


async def run_server(config: ServerConfig) -> None:
    if config.store.url:  # PostgreSQL: one of several servers, leader or standby
        from llmgw.server.ha import serve_replicated

        await serve_replicated(config)
    else:
        await serve_server(config)

"""`llmgw server`: the control plane as the CLI runs it."""

from __future__ import annotations

from llmgw.config.server import ServerConfig
from llmgw.server.service import serve_server


async def run_server(config: ServerConfig) -> None:
    await serve_server(config)

"""The OpenAI-compatible HTTP front door: routes by `model` to engines, directly.

`serve_router(config, table_source=...)` runs it; `run_router(config, request)` wires the
server's endpoint table through `llmgw.transport.client.request`.
"""

from llmgw.router.service import Router, TableSource, run_router, serve_router

__all__ = ["Router", "TableSource", "run_router", "serve_router"]

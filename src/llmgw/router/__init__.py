"""The OpenAI-compatible HTTP front door: routes by `model` to engines, directly.

`llmgw.router.service.serve_router(config, table_source=...)` runs it;
`llmgw.router.service.run_router(config, request)` wires the server's endpoint table
through `llmgw.transport.client.request`. This face imports nothing, so that importing
one of the router's pure modules loads neither trio nor the rest of the router.
"""

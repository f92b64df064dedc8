"""HTTP/1.1 for llmgw: the sans-IO core and the small trio shells around it.

Pure (no sockets, no clock; fenced by tests/unit/test_architecture.py):
  grammar   limits, H1Error, the head patterns and the one header-field loop
  chunked   the one reader of chunked framing (relayed, gathered or whole)
  request   RequestParser: a client's requests, bodies read
  response  parse_response_head and ResponseParser: an engine's answers
  writers   the one writer of body framing: chunked, Content-Length, until close
  listen    the small read-only listener's request, routing, token check and answer

trio shells (I/O only):
  serve     serve_http: that listener on a port (the server's and agent's /metrics)
  client    get: a one-off GET (the agent's health probe, `llmgw dev`)

The router's own shells (client connections, pooled engine connections, the relay of an
answer) are in llmgw.router.connection: http, upstream, relay. This face imports nothing.
"""

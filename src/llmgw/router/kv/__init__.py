"""KV-cache-aware routing in the router: following the agents' relays of their engines'
KV-cache events (`follow`, the pure core; `links`, the sockets) into one index per model,
and choosing a replica by what it holds (`policy`). This face imports nothing."""

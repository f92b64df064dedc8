"""The router's connections: the client side (HTTP/1.1 shell, socket I/O, the JSON depth
pre-scan), pooled keep-alive connections to engines and the relay of one answer, and the
meter of the router's own loop lag. This face imports nothing."""

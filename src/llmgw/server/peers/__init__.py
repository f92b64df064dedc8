"""The server's peers: their sessions (sessions.py, the control plane), the ZeroMQ shell
(service.py), the node table (node_states.py), interning."""

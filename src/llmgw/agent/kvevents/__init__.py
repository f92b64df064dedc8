"""The agent's side of KV-cache events: each engine's stream of batches, received on a
loopback socket (agent/engines/kv_events.py sets the engine's endpoints)."""

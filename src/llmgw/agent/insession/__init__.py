"""What runs inside an engine's own session, not in the agent: the launcher that starts a
plan's processes, and the pre-flight probe it runs first with the engine's Python."""

"""llmgw: LLM inference on bare-metal GPU clusters, on trio and ZeroMQ."""

__version__ = "0.1.0"

# Bumped whenever a message class changes shape; sent in every first message.
PROTOCOL_VERSION = 1

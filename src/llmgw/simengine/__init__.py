"""The simulated engine: `python -m llmgw.simengine`, vLLM's HTTP API without a GPU.

It accepts the vLLM- and SGLang-shaped command lines llmgw emits (see args.py), serves
/health, /v1/models, /v1/completions, /v1/chat/completions (streamed or not),
/v1/embeddings and /metrics, and simulates load time, token rate, crashes and gangs.
"""

from llmgw.simengine.args import SimArgs, parse_args
from llmgw.simengine.server import main, run

__all__ = ["SimArgs", "main", "parse_args", "run"]

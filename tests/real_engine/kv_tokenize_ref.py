"""vLLM's own token ids for prompts and chat messages, to hold llmgw's tokenizer to.

Run with the vLLM venv's python:  kv_tokenize_ref.py CASES.json
CASES.json: {"model": DIR, "chat": [a /v1/chat/completions body without "model", ...],
             "completion": [a /v1/completions body without "model", ...],
             "formats": [chat template, ...]}   (optional)
Prints one JSON line: {"now": ISO time, "chat": [ids or "error: ..."], "completion": [ids],
"formats": ["string" or "openai", ...]} (vLLM's content-format detection per template).

The ids come from vLLM's renderer as its OpenAI server drives it (renderer_from_config on
the model's ModelConfig; renderers/online_renderer.py, preprocess_chat): for a chat body, a
ChatCompletionRequest, its build_chat_params with the server's defaults under them (the
tools' pydantic dump, tokenize=False), render_messages, then tokenize_prompt with the
request's build_tok_params; for a completion body, a CompletionRequest and tokenize_prompt
of its text prompt with the request's build_tok_params.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime


def main(cases_path: str) -> None:
    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)
    from vllm.config import ModelConfig, VllmConfig
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.renderers.params import merge_kwargs
    from vllm.renderers.registry import renderer_from_config

    renderer = renderer_from_config(VllmConfig(model_config=ModelConfig(model=cases["model"])))
    now = datetime.now().isoformat()  # what transformers' strftime_now reads, give or take
    chat: list[object] = []
    for body in cases["chat"]:
        try:
            req = ChatCompletionRequest(model="m", **body)
            tools = None if req.tools is None else [t.model_dump() for t in req.tools]
            params = req.build_chat_params(None, "auto").with_defaults(
                merge_kwargs(None, dict(tools=tools, tokenize=False)))
            _, prompt = renderer.render_messages(req.messages, params)
            tok = renderer.tokenize_prompt(prompt, req.build_tok_params(renderer.model_config))
            chat.append(list(tok["prompt_token_ids"]))
        except Exception as e:  # the test compares refusals too
            chat.append(f"error: {type(e).__name__}: {e}")
    completion = []
    for case in cases["completion"]:
        req = CompletionRequest(model="m", **case)
        tp = req.build_tok_params(renderer.model_config)
        completion.append(list(renderer.tokenize_prompt({"prompt": req.prompt}, tp)["prompt_token_ids"]))
    from vllm.renderers.hf import _detect_content_format

    formats = [_detect_content_format(t, default="string") for t in cases.get("formats", [])]
    print(json.dumps({"now": now, "chat": chat, "completion": completion, "formats": formats}))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])

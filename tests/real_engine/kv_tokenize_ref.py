"""vLLM's own token ids for prompts and chat messages, to hold llmgw's tokenizer to.

Run with the vLLM venv's python:  kv_tokenize_ref.py CASES.json
CASES.json: {"model": DIR, "chat": [{"messages": [...], "kwargs": {...}}],
             "completion": [{"prompt": ..., "add_special_tokens": bool}]}
            "formats": [chat template, ...]}   (optional)
Prints one JSON line: {"now": ISO time, "chat": [ids or "error: ..."], "completion": [ids],
"formats": ["string" or "openai", ...]} (vLLM's content-format detection per template).

The ids come from vLLM's renderer as its OpenAI server builds it (renderer_from_config on
the model's ModelConfig): render_messages with ChatParams for /v1/chat/completions (its
chat_template_kwargs as ChatCompletionRequest.build_chat_params merges them), and
tokenize_prompt with TokenizeParams(add_special_tokens) for /v1/completions.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime


def main(cases_path: str) -> None:
    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)
    from vllm.config import ModelConfig, VllmConfig
    from vllm.renderers.params import ChatParams, TokenizeParams, merge_kwargs
    from vllm.renderers.registry import renderer_from_config

    renderer = renderer_from_config(VllmConfig(model_config=ModelConfig(model=cases["model"])))
    now = datetime.now().isoformat()  # what transformers' strftime_now reads, give or take
    chat: list[object] = []
    for case in cases["chat"]:
        kwargs = dict(case.get("kwargs") or {})
        # ChatCompletionRequest's defaults: add_generation_prompt true, continue_final_message false.
        extra = {"add_generation_prompt": kwargs.pop("add_generation_prompt", True),
                 "continue_final_message": kwargs.pop("continue_final_message", False),
                 **{k: kwargs.pop(k) for k in ("documents", "tools") if k in kwargs}}
        params = ChatParams(chat_template_kwargs=merge_kwargs(kwargs, extra))
        try:
            _, prompt = renderer.render_messages(case["messages"], params)
            chat.append(list(prompt["prompt_token_ids"]))
        except Exception as e:  # the test compares refusals too
            chat.append(f"error: {type(e).__name__}: {e}")
    completion = []
    for case in cases["completion"]:
        tp = TokenizeParams(max_total_tokens=None, add_special_tokens=case["add_special_tokens"])
        completion.append(list(renderer.tokenize_prompt({"prompt": case["prompt"]}, tp)["prompt_token_ids"]))
    from vllm.renderers.hf import _detect_content_format

    formats = [_detect_content_format(t, default="string") for t in cases.get("formats", [])]
    print(json.dumps({"now": now, "chat": chat, "completion": completion, "formats": formats}))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])

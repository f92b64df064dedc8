"""llmgw's prompt tokenizer makes the ids vLLM itself makes: the same prompts and chat
messages through vLLM's own renderer (kv_tokenize_ref.py, run with the vLLM venv's python)
and through llmgw.kvcache.tokenize, for two tokenizers of the tiny model:

- as made (a ChatML template in chat_template.jinja, no BOS from the post-processor);
- a Llama-like variant: a post-processor that prepends BOS (and add_bos_token false in the
  config, which transformers 5 ignores beside a tokenizer.json), the template in
  tokenizer_config.json writing {{ bos_token }}, looping over content parts (vLLM's
  "openai" content format), with strftime_now, tojson, raise_exception, loop controls,
  a {% generation %} block and indented blocks that trim_blocks/lstrip_blocks strip, and an
  added token only the config names.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from llmgw.kvcache import tokenize
from llmgw.kvcache.chat import Template

pytestmark = pytest.mark.real_engine
HERE = Path(__file__).resolve().parent

LLAMA_LIKE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0] %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = none %}{% set loop_messages = messages %}{% endif %}\n"
    "<|im_start|>system\nDate: {{ strftime_now('%Y-%m-%d') }}\n"
    "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
    "{% if system %}{% for part in system['content'] %}{{ part['text'] }}{% endfor %}{% endif %}<|im_end|>\n"
    "{% for message in loop_messages %}\n"
    "    {% if message['role'] not in ['user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}\n"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if loop.index0 > 3 %}{% break %}{% endif %}"
    "{{ part['text'] }}{% if not loop.last %} | {% endif %}{% endfor %}{% endif %}\n"
    "    {% if message.tool_calls %}{% for call in message.tool_calls %}"
    "<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}{% endif %}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}.{% endgeneration %}{% endif %}<|im_end|>\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>\n{% endif %}{% endif %}"
)

SYSTEM = {"role": "system", "content": "You are terse. Réponds en français si demandé. 日本語も可。"}
USER = {"role": "user", "content": "Hello ✓ — what's 2+2?\r\nAlso: naïve café, 🧪🧬, <|im_start|> literal"}
TURNS = [SYSTEM, USER, {"role": "assistant", "content": "4."},
         {"role": "user", "content": "And 3+3?"}]
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 3}'}}]}
TOOL = {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "6"}]}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

CHAT: list[dict[str, Any]] = [  # /v1/chat/completions bodies (without "model")
    {"messages": [USER]},
    {"messages": [SYSTEM, USER]},
    {"messages": TURNS},
    {"messages": TURNS, "add_generation_prompt": False},
    {"messages": [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "part one"},
                                                       {"type": "text", "text": "part two ü"}]}]},
    {"messages": [{"role": "developer", "content": "Dev rules."}, USER, SYSTEM]},
    {"messages": [USER, {"role": "assistant", "content": "Partial answ"}],
     "add_generation_prompt": False, "continue_final_message": True},
    {"messages": [SYSTEM, USER, CALL, TOOL], "tools": TOOLS},
    {"messages": [{"role": "system", "content": "x-anthropic-billing-header: cch=123\nStable system."}, USER]},
    {"messages": [USER], "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": [USER], "reasoning_effort": "none"},
    {"messages": [USER], "add_special_tokens": True},
    {"messages": [{"role": "bogus", "content": "?"}]},
]
COMPLETION: list[dict[str, Any]] = [  # /v1/completions bodies (without "model")
    {"prompt": "Hello world"},
    {"prompt": "Hello world", "add_special_tokens": False},
    {"prompt": USER["content"], "add_special_tokens": True},
    {"prompt": "   leading and trailing spaces \n\n", "add_special_tokens": True},
    {"prompt": "<|im_start|>user\nhi<|im_end|><tool_call>", "add_special_tokens": True},
    {"prompt": "The GNU General Public License is a free, copyleft license. " * 60, "add_special_tokens": True},
]

# Templates whose content format (string or openai) vLLM's detector and ours must agree on.
FORMATS = [
    LLAMA_LIKE,
    "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
    "{% set ms = messages[1:] %}{% for m in ms %}{% for p in m['content'] | list %}{% endfor %}{% endfor %}",
    "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(m.content) }}{% endfor %}",
    "{% macro show(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}{{ show([1, 2]) }}",
    "{% for p in content %}{% endfor %}",
    "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}",
]


def _llama_like(src: Path, out: Path) -> Path:
    out.mkdir()
    shutil.copy(src / "config.json", out / "config.json")
    tj = json.loads((src / "tokenizer.json").read_text())
    tj["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
    }
    (out / "tokenizer.json").write_text(json.dumps(tj))
    config = json.loads((src / "tokenizer_config.json").read_text())
    size = len(tj["model"]["vocab"])
    config.update(add_bos_token=False, chat_template=LLAMA_LIKE, added_tokens_decoder={
        **{str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in tj["added_tokens"]},
        str(size): {"content": "<tool_call>", "lstrip": False, "normalized": False, "rstrip": False,
                    "single_word": False, "special": False}})
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _files(folder: Path) -> dict[str, bytes]:
    names = [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]
    return {n: (folder / n).read_bytes() for n in tokenize.wanted(names)}


def _vllm(vllm_venv: Path, folder: Path, tmp: Path) -> dict[str, Any]:
    cases = tmp / "cases.json"
    cases.write_text(json.dumps({"model": str(folder), "chat": CHAT, "completion": COMPLETION,
                                 "formats": FORMATS}))
    r = subprocess.run([str(vllm_venv / "bin" / "python"), str(HERE / "kv_tokenize_ref.py"), str(cases)],
                       capture_output=True, text=True, timeout=300, cwd=tmp)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _ours(tok: tokenize.PromptTokenizer, body: dict[str, Any], now: datetime) -> list[int] | str:
    try:
        return tok.encode_chat(now=now, **tokenize.chat_args(body))
    except tokenize.NotText as e:
        return f"error: {e}"


@pytest.mark.parametrize("variant", ["as_made", "llama_like"])
def test_the_ids_are_vllms(variant: str, vllm_venv: Path, tiny_model: Path, tmp_path: Path) -> None:
    folder = tiny_model if variant == "as_made" else _llama_like(tiny_model, tmp_path / "llama-like")
    theirs = _vllm(vllm_venv, folder, tmp_path)
    tok = tokenize.load(_files(folder))
    assert isinstance(tok, tokenize.PromptTokenizer), tok
    assert tok.caveat == ""
    now = datetime.fromisoformat(theirs["now"])
    for case, want in zip(CHAT, theirs["chat"], strict=True):
        got = _ours(tok, case, now)
        if isinstance(want, str):  # vLLM refused it: so do we
            assert isinstance(got, str), (case, want, got)
        else:
            args = tokenize.chat_args(case)
            del args["add_special_tokens"]
            assert got == want, (case, tok.render_chat(now=now, **args))
    for case, want in zip(COMPLETION, theirs["completion"], strict=True):
        assert tok.encode_completion(case["prompt"], add_special_tokens=case.get("add_special_tokens", True)) == want, case
    # Cut for routing, a long prompt's ids are a prefix of the engine's.
    long = COMPLETION[5]["prompt"]
    cut = tokenize.load(_files(folder), max_tokens=40).encode_completion(long)
    assert 30 <= len(cut) <= 40 and cut == theirs["completion"][5][: len(cut)]
    # The cases did what they claim: BOS from the post-processor only where it prepends one,
    # the openai content format for the Llama-like template, and one refusal.
    first = theirs["completion"][0]
    assert (first[0] == 0) == (variant == "llama_like")
    assert theirs["completion"][1][0] != 0
    assert [isinstance(w, str) for w in theirs["chat"]].count(True) == (1 if variant == "llama_like" else 0)
    # A chat request's add_special_tokens adds the post-processor's BOS before the template's.
    assert theirs["chat"][11][:2] == ([0, 0] if variant == "llama_like" else theirs["chat"][0][:2])
    assert tok.template().content_format == ("openai" if variant == "llama_like" else "string")
    assert [Template(t).content_format for t in FORMATS] == theirs["formats"]
    assert set(theirs["formats"]) == {"string", "openai"}
    if variant == "llama_like":  # the token only tokenizer_config.json names is one id, for both
        tool_call = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
        assert tool_call in theirs["completion"][4]

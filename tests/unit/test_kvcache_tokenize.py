"""The router's prompt tokenizer (llmgw.kvcache.tokenize, llmgw.kvcache.chat) on a tokenizer
built here with `tokenizers`: files read as transformers reads them, templates rendered in
transformers' jinja environment and vLLM's conversation, prompts bounded to a prefix, and a
reason (never an exception) where no tokenizer can be had. That the ids equal vLLM's own is
tests/real_engine/test_kv_tokenize.py."""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from llmgw.kvcache import tokenize
from llmgw.kvcache.chat import Template, conversation
from llmgw.kvcache.tokenize import NotText, PromptTokenizer, Unavailable

WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "user", "assistant", "system", "hi", "a", "b",
         "[", "]", ":", "|", "café", "✓", "x", "y"]
NOW = datetime(2024, 7, 26, 12, 0)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer_json(bos: bool = True) -> bytes:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                           special_tokens=[("<s>", 1)])
    return tok.to_str().encode()


def files(template: str | None = CHATML, bos: bool = True, **config: Any) -> dict[str, bytes]:
    cfg: dict[str, Any] = {"bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>",
                           "tokenizer_class": "PreTrainedTokenizerFast", **config}
    if template is not None:
        cfg["chat_template"] = template
    return {"tokenizer.json": tokenizer_json(bos), "tokenizer_config.json": json.dumps(cfg).encode()}


def load(f: dict[str, bytes] | None = None, **kw: Any) -> PromptTokenizer:
    tok = tokenize.load(files() if f is None else f, **kw)
    assert isinstance(tok, PromptTokenizer), tok
    return tok


def ids(*words: str) -> list[int]:
    return [WORDS.index(w) for w in words]


# ---------------------------------------------------------------------------------------------
# Loading


def test_wanted_names_the_files_transformers_reads() -> None:
    listing = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "special_tokens_map.json", "additional_chat_templates/tool_use.jinja",
               "additional_chat_templates/deep/x.jinja", "merges.txt"]
    assert tokenize.wanted(listing) == ["additional_chat_templates/tool_use.jinja", "chat_template.jinja",
                                        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]


@pytest.mark.parametrize("module", ["tokenizers", "jinja2"])
def test_a_missing_library_is_a_reason(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    got = tokenize.load(files())
    assert isinstance(got, Unavailable)
    assert str(got).startswith("no tokenizer: ") and module in got.reason and "llmgw[kv]" in got.reason


@pytest.mark.parametrize(("f", "why"), [
    ({"tokenizer_config.json": b"{}"}, "no tokenizer.json"),
    ({"tokenizer.json": b"{not json"}, "cannot read the tokenizer"),
    ({"tokenizer.json": tokenizer_json(), "tokenizer_config.json": b"[1]"}, "not a JSON object"),
])
def test_bad_or_missing_files_are_a_reason(f: dict[str, bytes], why: str) -> None:
    got = tokenize.load(f)
    assert isinstance(got, Unavailable) and why in got.reason


def test_the_post_processor_decides_bos_not_add_bos_token() -> None:
    # transformers 5 drops add_bos_token/add_eos_token when a tokenizer.json exists.
    assert load(files(add_bos_token=False)).encode_completion("hello world") == ids("<s>", "hello", "world")
    assert load(files(bos=False, add_bos_token=True)).encode_completion("hello world") == ids("hello", "world")
    assert load().encode_completion("hello world", add_special_tokens=False) == ids("hello", "world")


def test_special_and_added_tokens_from_the_config_are_matched_whole() -> None:
    f = files(added_tokens_decoder={"19": {"content": "<|im_start|>", "special": True}},
              extra_special_tokens=["<|im_end|>"])
    tok = load(f)
    got = tok.encode_completion("hi<|im_start|>x<|im_end|>", add_special_tokens=False)
    assert got[0] == WORDS.index("hi") and len(got) == 4 and got[2] == WORDS.index("x")
    # Without them the markers are plain text: split into pieces the vocabulary lacks.
    assert len(load(files()).encode_completion("hi<|im_start|>x", add_special_tokens=False)) > 3
    assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}


def test_special_tokens_map_is_read_without_added_tokens_decoder() -> None:
    f = files() | {"special_tokens_map.json": json.dumps({"bos_token": "hello", "pad_token": "x"}).encode()}
    assert load(f).special_tokens == {"bos_token": "hello", "eos_token": "</s>", "pad_token": "x"}
    f2 = files(added_tokens_decoder={}) | {"special_tokens_map.json": b'{"bos_token": "hello"}'}
    assert load(f2).special_tokens["bos_token"] == "<s>"


def test_a_tokenizer_class_with_its_own_pipeline_carries_a_caveat() -> None:
    assert load().caveat == ""
    assert "LlamaTokenizerFast" in load(files(tokenizer_class="LlamaTokenizerFast")).caveat


# ---------------------------------------------------------------------------------------------
# /v1/completions


def test_completion_prompts_of_every_shape() -> None:
    tok = load()
    assert tok.encode_completion("hello café ✓") == ids("<s>", "hello", "café", "✓")
    assert tok.encode_completion([5, 6, 7]) == [5, 6, 7]
    assert tok.encode_completion(["hi", "world"]) == ids("<s>", "hi")  # a batch routes by its first
    assert tok.encode_completion([[3, 4], [5]]) == [3, 4]
    assert tok.encode_completion("") == ids("<s>")
    for bad in ([], [True, 1], [1.5], [{"a": 1}]):
        with pytest.raises(NotText):
            tok.encode_completion(bad)  # type: ignore[arg-type]


def test_a_long_prompt_is_cut_to_a_prefix_of_its_ids() -> None:
    tok = load(max_tokens=50)
    text = " ".join(["hello world"] * 5000)
    got = tok.encode_completion(text)
    full = load(max_tokens=10**6).encode_completion(text)
    assert 0 < len(got) <= 50 and got == full[: len(got)] and got[0] == WORDS.index("<s>")
    assert tok.max_chars == 50 * min(tokenize.CHARS_PER_TOKEN, max(len(w) for w in WORDS))
    assert tok.encode_completion(list(range(100))) == list(range(50))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(WORDS[3:] + ["zz", "\n", "  "]), max_size=200), st.integers(1, 40))
def test_any_cut_is_a_prefix(words: list[str], max_tokens: int) -> None:
    text = " ".join(words)
    got = load(max_tokens=max_tokens).encode_completion(text)
    full = load(max_tokens=10**6).encode_completion(text)
    assert got == full[: len(got)] and len(got) <= max_tokens
    if len(text) <= load(max_tokens=max_tokens).max_chars:
        assert got == full[:max_tokens]


# ---------------------------------------------------------------------------------------------
# /v1/chat/completions


def test_chat_renders_the_template_and_adds_no_special_tokens() -> None:
    tok = load(files("{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} | {% endfor %}"
                     "{% if add_generation_prompt %}assistant :{% endif %}"))
    msgs = [{"role": "system", "content": "a"}, {"role": "user", "content": "hi café"}]
    assert tok.render_chat(msgs, now=NOW) == "<s>system : a | user : hi café | assistant :"
    # One BOS, from the template: encode_chat adds none of its own.
    assert tok.encode_chat(msgs, now=NOW) == ids("<s>", "system", ":", "a", "|", "user", ":", "hi", "café",
                                                 "|", "assistant", ":")
    assert tok.encode_chat(msgs, now=NOW, add_generation_prompt=False)[-1] == WORDS.index("|")


def test_transformers_jinja_environment() -> None:
    source = ("{% for m in messages %}\n"
              "    {% if m['role'] == 'user' %}\n"
              "{{ m['content'] }}\n"
              "    {% endif %}\n"
              "{% if loop.index0 >= 1 %}{% break %}{% endif %}"
              "{% endfor %}"
              "{{ tools | tojson }}|{{ strftime_now('%d %b %Y') }}|{{ bos_token }}{{ flag }}"
              "{% generation %}G{% endgeneration %}")
    t = Template(source)
    text = t.render([{"role": "user", "content": "a<b>"}, {"role": "user", "content": "c"},
                     {"role": "user", "content": "never"}],
                    add_generation_prompt=False, continue_final_message=False,
                    special_tokens={"bos_token": "<s>"}, now=NOW,
                    tools=[{"name": "é<&>"}], kwargs={"flag": "!"})
    # trim_blocks eats the newline after a block tag, lstrip_blocks the indent before one;
    # tojson keeps non-ASCII and HTML characters as they are; loop controls stop the loop.
    assert text == 'a<b>\nc\n[{"name": "é<&>"}]|26 Jul 2024|<s>!G'


def test_a_template_that_raises_refuses_the_request() -> None:
    tok = load(files("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"))
    with pytest.raises(NotText, match="user first"):
        tok.encode_chat([{"role": "assistant", "content": "x"}], now=NOW)
    with pytest.raises(NotText, match="chat_template_kwargs"):
        tok.encode_chat([{"role": "user", "content": "x"}], now=NOW, chat_template_kwargs={"tokenize": False})


LOOPS = "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}"
MACRO = ("{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
         "{% set msgs = messages[1:] %}{% for m in msgs %}{{ show(m.content) }}{% endfor %}")


@pytest.mark.parametrize(("source", "fmt"), [(CHATML, "string"), (LOOPS, "openai"), (MACRO, "openai"),
                                              ("{% for p in content %}{% endfor %}", "openai"),
                                              ("{% for m in messages %}{{ m.content }}{% endfor %}", "string")])
def test_the_content_format_is_detected_as_vllm_does(source: str, fmt: str) -> None:
    assert Template(source).content_format == fmt


def test_content_parts_per_format() -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, "b", {"type": "text", "text": None}]},
            {"role": "tool", "tool_call_id": "t", "content": [{"type": "text", "text": "r1"},
                                                              {"type": "text", "text": "r2"}]}]
    assert conversation(msgs, "string") == [{"role": "user", "content": "a\nb"},
                                            {"role": "tool", "content": "r1\nr2", "tool_call_id": "t"}]
    assert conversation(msgs, "openai")[0]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert conversation(msgs, "openai")[1]["content"] == "r1\nr2"  # tool results stay one string
    with pytest.raises(NotText, match="image_url"):
        conversation([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "string")
    with pytest.raises(NotText):
        conversation([{"content": "no role"}], "string")


def test_tool_calls_reasoning_and_the_billing_header() -> None:
    msgs = [{"role": "system", "content": "x-anthropic-billing-header: cch=1\nkeep"},
            {"role": "assistant", "content": None, "reasoning": "r", "name": "n", "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                {"type": "function", "function": {"name": "g", "arguments": "not json"}},
                {"type": "function", "function": {"name": "h", "arguments": ""}}]},
            {"role": "assistant", "content": "z", "tool_calls": []}]
    conv = conversation(msgs, "string")
    assert conv[0] == {"role": "system", "content": "keep"}
    assert [c["function"]["arguments"] for c in conv[1]["tool_calls"]] == [{"a": 1}, {}, {}]
    # In the order vLLM's request model leaves the keys: declared ones first, as a template's
    # tojson of a call writes them.
    assert [list(c) for c in conv[1]["tool_calls"]] == [["function", "type"]] * 3
    assert list(conv[1]["tool_calls"][0]["function"]) == ["arguments", "name"]
    assert conv[1]["reasoning"] == conv[1]["reasoning_content"] == "r" and conv[1]["name"] == "n"
    assert "tool_calls" not in conv[2]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the request is not changed


def test_developer_messages_become_one_first_system_message() -> None:
    tok = load(files(CHATML.replace("<|im_start|>", "[").replace("<|im_end|>", "]")))
    msgs = [{"role": "developer", "content": "a"}, {"role": "user", "content": "hi"},
            {"role": "system", "content": "b"}]
    assert tok.render_chat(msgs, now=NOW, add_generation_prompt=False) == "[system\na\n\nb]\n[user\nhi]\n"
    knows = load(files("{% if m == 'developer' %}{% endif %}{% for m in messages %}{{ m.role }};{% endfor %}"))
    assert knows.render_chat(msgs, now=NOW) == "developer;user;system;"


def test_continue_final_message() -> None:
    tok = load()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello wor"}]
    text = tok.render_chat(msgs, now=NOW, add_generation_prompt=False, continue_final_message=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello wor"
    with pytest.raises(NotText):
        tok.render_chat(msgs, now=NOW, add_generation_prompt=True, continue_final_message=True)


def test_which_template() -> None:
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    tok = load(files(named))  # type: ignore[arg-type]
    user = [{"role": "user", "content": "x"}]
    assert tok.render_chat(user, now=NOW) == "D"
    assert tok.render_chat(user, now=NOW, tools=[{"name": "f"}]) == "T"
    assert tok.render_chat(user, now=NOW, chat_template="tool_use") == "T"
    assert tok.render_chat(user, now=NOW, chat_template="literal {{ 1 + 1 }}") == "literal 2"
    # A chat_template.jinja file wins over the config's entry.
    assert load(files("C") | {"chat_template.jinja": b"F"}).render_chat(user, now=NOW) == "F"
    none = load(files(None))
    assert not none.has_chat_template
    with pytest.raises(NotText, match="no chat template"):
        none.encode_chat(user, now=NOW)
    with pytest.raises(NotText, match="no default"):
        load(files([{"name": "a", "template": "A"}])).encode_chat(user, now=NOW)  # type: ignore[arg-type]


def test_chat_args_build_what_vllms_server_does() -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    args = tokenize.chat_args(body)
    assert args == {"messages": body["messages"], "add_generation_prompt": True, "continue_final_message": False,
                    "add_special_tokens": False, "tools": None, "documents": None, "chat_template": None,
                    "chat_template_kwargs": {}}
    args = tokenize.chat_args({**body, "reasoning_effort": "none", "add_generation_prompt": False,
                               "chat_template_kwargs": {"x": 1, "add_generation_prompt": True},
                               "tools": [{"type": "function", "function": {"name": "f", "strict": True}}]})
    assert args["chat_template_kwargs"] == {"x": 1, "reasoning_effort": "none", "enable_thinking": False}
    assert args["add_generation_prompt"] is False  # the request's field over its kwargs
    assert args["tools"] == [{"type": "function", "function": {"name": "f", "description": None,
                                                               "parameters": None, "strict": True}}]
    kept = tokenize.chat_args({**body, "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}})
    assert kept["chat_template_kwargs"] == {"enable_thinking": False, "reasoning_effort": "high"}
    assert "reasoning_effort" not in tokenize.chat_args({**body, "reasoning_effort": "auto"})["chat_template_kwargs"]
    for bad in ({"messages": "x"}, {**body, "tools": {}}, {**body, "tools": [1]}, {**body, "chat_template_kwargs": 1}):
        with pytest.raises(NotText):
            tokenize.chat_args(bad)


def test_a_chat_request_may_ask_for_special_tokens() -> None:
    tok = load(files("{% for m in messages %}{{ m['content'] }}{% endfor %}"))
    user = [{"role": "user", "content": "hi"}]
    assert tok.encode_chat(user, now=NOW) == ids("hi")
    assert tok.encode_chat(user, now=NOW, add_special_tokens=True) == ids("<s>", "hi")

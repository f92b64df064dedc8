"""A prompt to token ids as vLLM 0.32 makes them, so the router chains the engine's blocks.

vLLM's tokenizer for a model with a tokenizer.json is transformers' TokenizersBackend
(PreTrainedTokenizerFast) around HF's Rust `tokenizers`. This module builds the same Rust
tokenizer from the same files, as transformers 5 does in from_pretrained:

- tokenizer.json as it is (TokenizerFast.from_file), its truncation and padding off (the
  router bounds the text itself, below);
- tokenizer_config.json's add_bos_token/add_eos_token are dropped when a tokenizer.json
  exists (tokenization_utils_base.py, _from_pretrained): its post-processor decides the
  BOS/EOS of /v1/completions;
- the named special tokens (bos_token ... mask_token, as strings or {"content": ...}; from
  special_tokens_map.json when the config has no added_tokens_decoder), the config's
  added_tokens_decoder and extra_special_tokens are added as special tokens where the
  tokenizer lacks them; split_special_tokens sets encode_special_tokens;
- the chat template from chat_template.jinja, additional_chat_templates/*.jinja or the
  config's chat_template (a string or a list of named templates), the file first.

/v1/completions encodes the prompt with add_special_tokens (true unless the request says
otherwise: renderers/base.py, _tokenize_prompt); /v1/chat/completions renders the template
to text (the OpenAI server passes tokenize=False for an HF tokenizer:
renderers/online_renderer.py, preprocess_chat) and encodes it the same way with the
request's add_special_tokens, false by default (chat_completion/protocol.py): a template
writes its own BOS. `chat_args` turns a request body into encode_chat's arguments as the
server does (ChatCompletionRequest.build_chat_params; tools as their pydantic dump).

Not reproduced: a tokenizer_class with its own __init__ (LlamaTokenizer, Qwen2Tokenizer,
...) rebuilds its normalizer and pre-tokenizer in transformers 5's own code and keeps only
the vocabulary and merges of tokenizer.json (tokenization_utils_tokenizers.py,
convert_to_native_format); the Mistral regex patch (vocabularies over 100,000 of Mistral
models); a processor's chat template (multimodal models); vLLM's built-in fallback
templates; mistral-format tokenizers. `caveat` names the first that applies.

Routing needs the prefix, not the whole prompt: text beyond `max_tokens` tokens' worth is
cut before encoding, and tokens near the cut are dropped, so the ids are always a prefix of
what the engine makes. A token's worth is its length in characters up to CHARS_PER_TOKEN
(vLLM's own bound, renderers/params.py _text_len_check, takes the longest token, tens of
characters, which would let a long prompt be encoded whole): prose averages 4 or 5
characters a token, so a cut prompt still gives about max_tokens ids, and a whitespace-heavy
one somewhat fewer, which costs routing only the tail of its prefix.

Pure: the caller reads the files (`wanted` says which) and passes their bytes, and passes
the time to a chat template that writes the date. `tokenizers` and jinja2 are imported
when a tokenizer is built: without them `load` answers Unavailable, never raises.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import attrs

from llmgw.kvcache.chat import NotText, Template

TOKENIZER = "tokenizer.json"
CONFIG = "tokenizer_config.json"
SPECIAL_MAP = "special_tokens_map.json"
TEMPLATE = "chat_template.jinja"
TEMPLATES_DIR = "additional_chat_templates/"
NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
DEFAULT_MAX_TOKENS = 16384
CHARS_PER_TOKEN = 8
CUT_SLACK_CHARS = 64  # text near a cut may merge differently; tokens ending there are dropped
OWN_PIPELINE_FREE = {None, "PreTrainedTokenizerFast", "TokenizersBackend"}

__all__ = ["NotText", "PromptTokenizer", "Unavailable", "chat_args", "load", "wanted"]


@attrs.frozen
class Unavailable:
    """No tokenizer for this model; the router routes it by prefix_affinity instead."""

    reason: str

    def __str__(self) -> str:
        return f"no tokenizer: {self.reason}"


def wanted(names: Iterable[str]) -> list[str]:
    """The files of a model folder's listing (paths relative to it, with '/') that `load`
    reads."""
    fixed = {TOKENIZER, CONFIG, SPECIAL_MAP, TEMPLATE}
    return sorted(n for n in names if n in fixed or (
        n.startswith(TEMPLATES_DIR) and n.endswith(".jinja") and n.count("/") == 1))


def _text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _json(files: Mapping[str, bytes], name: str) -> dict[str, Any]:
    raw = files.get(name)
    if raw is None:
        return {}
    value = json.loads(raw.decode("utf-8"))
    if not isinstance(value, dict):
        raise ValueError(f"{name} is not a JSON object")
    return value


def _templates(files: Mapping[str, bytes], config: Mapping[str, Any]) -> dict[str, str] | str | None:
    """transformers' chat_template: the files over the config's entry; a dict when named."""
    found: dict[str, str] = {}
    if TEMPLATE in files:
        found["default"] = files[TEMPLATE].decode("utf-8")
    for name in files:
        if name.startswith(TEMPLATES_DIR) and name.endswith(".jinja"):
            found[name[len(TEMPLATES_DIR):-len(".jinja")]] = files[name].decode("utf-8")
    if found:
        return found["default"] if list(found) == ["default"] else found
    entry = config.get("chat_template")
    if isinstance(entry, list):
        return {t["name"]: t["template"] for t in entry if isinstance(t, Mapping)}
    return entry if isinstance(entry, str) else None


class PromptTokenizer:
    """One model's tokenizer and chat template, loaded once; encodes are thread-safe (the
    Rust tokenizer releases the GIL and keeps no per-call state here)."""

    def __init__(self, tok: Any, *, special_tokens: Mapping[str, str],
                 templates: dict[str, str] | str | None, max_tokens: int, caveat: str = "") -> None:
        self._tok = tok
        self.special_tokens = dict(special_tokens)
        self._templates = templates
        self._compiled: dict[str, Template] = {}
        self.max_tokens = max_tokens
        vocab = tok.get_vocab(with_added_tokens=True)
        self.max_chars = max_tokens * min(CHARS_PER_TOKEN, max((len(t) for t in vocab), default=1))
        self.caveat = caveat

    @property
    def has_chat_template(self) -> bool:
        return self._templates is not None

    def template(self, override: str | None = None, tools: object = None) -> Template:
        """tokenizer.get_chat_template: a name among several, else the text as given."""
        source: str | None
        named = self._templates if isinstance(self._templates, dict) else None
        if override is not None:
            source = named[override] if named and override in named else override
        elif named is not None:
            key = "tool_use" if tools is not None and "tool_use" in named else "default"
            if key not in named:
                raise NotText(f"several chat templates ({', '.join(sorted(named))}) and no default")
            source = named[key]
        else:
            source = self._templates if isinstance(self._templates, str) else None
        if source is None:
            raise NotText("the tokenizer has no chat template")
        if source not in self._compiled:
            if len(self._compiled) >= 8:  # request-given templates are bounded
                self._compiled.clear()
            self._compiled[source] = Template(source)
        return self._compiled[source]

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # The batch encoders release the GIL while they work; Tokenizer.encode holds it (a
        # 16k-token prompt kept a thread beside it waiting 70 ms), which would stall the
        # router's event loop even from trio.to_thread. The fast one skips the offsets.
        if len(text) <= self.max_chars:
            fast = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
            return list(fast([text], add_special_tokens=add_special_tokens)[0].ids)[: self.max_tokens]
        cut = text[: self.max_chars]
        enc = self._tok.encode_batch([cut], add_special_tokens=add_special_tokens)[0]
        keep = len(cut) - CUT_SLACK_CHARS
        ids: list[int] = []
        seen_text = False
        for tid, (start, end) in zip(enc.ids, enc.offsets, strict=True):
            # A post-processor's token has no text (0, 0): one before the text (a BOS) is
            # kept, one after it (an EOS) belongs after the whole prompt, not the cut.
            if end > keep or (seen_text and start == end == 0):
                break
            seen_text = seen_text or end > 0
            ids.append(tid)
        return ids[: self.max_tokens]

    def encode_completion(self, prompt: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
                          *, add_special_tokens: bool = True) -> list[int]:
        """The ids of a /v1/completions prompt (the first prompt of a batch: a request goes
        to one replica)."""
        if isinstance(prompt, str):
            return self._encode(prompt, add_special_tokens)
        if not isinstance(prompt, Sequence) or not prompt:
            raise NotText("an empty or malformed prompt")
        first = prompt[0]
        if isinstance(first, str):
            return self._encode(first, add_special_tokens)
        ids: Sequence[object] = prompt if isinstance(first, int) else first
        if isinstance(ids, Sequence) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            return [i for i in ids[: self.max_tokens] if isinstance(i, int)]
        raise NotText("a prompt is neither text nor token ids")

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, now: datetime,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    tools: list[Any] | None = None, documents: list[Any] | None = None,
                    chat_template: str | None = None,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text of a /v1/chat/completions request."""
        kwargs = dict(chat_template_kwargs or {})
        for key in ("chat_template", "tokenize"):  # vLLM refuses these in the request's kwargs
            if key in kwargs:
                raise NotText(f"chat_template_kwargs may not set {key}")
        template = self.template(chat_template, tools)
        return template.render(messages, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message,
                               special_tokens=self.special_tokens, now=now, tools=tools,
                               documents=documents, kwargs=kwargs)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, now: datetime,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    tools: list[Any] | None = None, documents: list[Any] | None = None,
                    chat_template: str | None = None,
                    chat_template_kwargs: Mapping[str, Any] | None = None,
                    add_special_tokens: bool = False) -> list[int]:
        """The ids of a /v1/chat/completions request: the rendered text, special tokens
        added only if the request asks. `now` is what strftime_now formats. Raises NotText
        (a per-request reason) when the messages cannot be rendered as the engine would."""
        try:
            text = self.render_chat(messages, now=now, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, tools=tools,
                                    documents=documents, chat_template=chat_template,
                                    chat_template_kwargs=chat_template_kwargs)
        except NotText:
            raise
        except Exception as e:  # a template's own raise_exception, or a bad value in it
            raise NotText(f"the chat template failed: {e}") from e
        return self._encode(text, add_special_tokens=add_special_tokens)


def _tool(tool: object) -> object:
    """A tool as vLLM's ChatCompletionToolsParam dumps it: type, then the function's name,
    description and parameters (None when absent), strict and defer_loading only when set."""
    if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
        raise NotText("a tool is not a function tool")
    f = tool["function"]
    function = {"name": f.get("name"), "description": f.get("description"), "parameters": f.get("parameters")}
    function |= {k: f[k] for k in ("strict", "defer_loading") if f.get(k) is not None}
    if tool.get("defer_loading") is not None and f.get("defer_loading") is None:
        function["defer_loading"] = tool["defer_loading"]
    out: dict[str, object] = {"type": tool.get("type", "function"), "function": function}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out


def chat_args(body: Mapping[str, Any]) -> dict[str, Any]:
    """encode_chat's keyword arguments (all but now) for a /v1/chat/completions body, as
    vLLM's server builds them: the request's fields over its chat_template_kwargs, None and
    "auto" left out, reasoning_effort turning enable_thinking on or off unless the kwargs
    say (chat_completion/protocol.py, build_chat_params). Raises NotText for a bad shape."""
    user = body.get("chat_template_kwargs") or {}
    if not isinstance(user, Mapping):
        raise NotText("chat_template_kwargs is not an object")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise NotText("tools is not a list")
    effort = body.get("reasoning_effort")
    extra: dict[str, Any] = {"documents": body.get("documents"), "reasoning_effort": effort}
    if effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = effort != "none"
    kwargs = {**user, **{k: v for k, v in extra.items() if v is not None and v != "auto"}}
    for key in ("add_generation_prompt", "continue_final_message"):  # the request's fields win
        kwargs.pop(key, None)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise NotText("messages is not a list")
    return {"messages": messages,
            "add_generation_prompt": bool(body.get("add_generation_prompt", True)),
            "continue_final_message": bool(body.get("continue_final_message", False)),
            "add_special_tokens": bool(body.get("add_special_tokens", False)),
            "tools": None if tools is None else [_tool(t) for t in tools],
            "documents": kwargs.pop("documents", None),
            "chat_template": body.get("chat_template"),
            "chat_template_kwargs": kwargs}


def load(files: Mapping[str, bytes], *,
         max_tokens: int = DEFAULT_MAX_TOKENS) -> PromptTokenizer | Unavailable:
    """The model's tokenizer from its files (name -> bytes, as `wanted` lists them), or why
    there is none. Never raises."""
    if max_tokens <= 0:
        return Unavailable(f"max_tokens {max_tokens} is not positive")
    try:
        from tokenizers import AddedToken, Tokenizer
    except ImportError:
        return Unavailable("the 'tokenizers' package is not installed (pip install 'llmgw[kv]')")
    try:
        import jinja2  # noqa: F401  (chat templates are compiled when first used)
    except ImportError:
        return Unavailable("the 'jinja2' package is not installed (pip install 'llmgw[kv]')")
    if TOKENIZER not in files:
        return Unavailable(f"no {TOKENIZER} (a slow, sentencepiece-only or mistral-format tokenizer)")
    try:
        config = _json(files, CONFIG)
        tok = Tokenizer.from_str(files[TOKENIZER].decode("utf-8"))
        tok.no_truncation()
        tok.no_padding()
        named: dict[str, object] = {k: config[k] for k in NAMED if k in config}
        if "added_tokens_decoder" not in config:
            for k, v in _json(files, SPECIAL_MAP).items():
                if k in NAMED:
                    named[k] = v
        special = {k: t for k, v in named.items() if (t := _text(v)) is not None}
        have = {str(t.content) for t in tok.get_added_tokens_decoder().values()}
        add: list[Any] = []
        for entry in (config.get("added_tokens_decoder") or {}).values():
            content = entry.get("content") if isinstance(entry, Mapping) else None
            if isinstance(content, str) and content not in have:
                add.append(AddedToken(content, single_word=bool(entry.get("single_word")),
                                      lstrip=bool(entry.get("lstrip")), rstrip=bool(entry.get("rstrip")),
                                      normalized=bool(entry.get("normalized", False)),
                                      special=bool(entry.get("special", True))))
                have.add(content)
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra_texts = list(extra.values()) if isinstance(extra, Mapping) else list(extra)
        for text in [*special.values(), *(t for e in extra_texts if (t := _text(e)) is not None)]:
            if text not in have:
                add.append(AddedToken(text, special=True, normalized=False))
                have.add(text)
        if add:
            tok.add_tokens(add)
        tok.encode_special_tokens = bool(config.get("split_special_tokens", False))
        klass = config.get("tokenizer_class")
        caveat = "" if klass in OWN_PIPELINE_FREE else (
            f"tokenizer_class {klass}: transformers 5 rebuilds its pre-tokenizer in its own code, "
            "the ids may differ from tokenizer.json's")
        return PromptTokenizer(tok, special_tokens=special, templates=_templates(files, config),
                               max_tokens=max_tokens, caveat=caveat)
    except Exception as e:  # a bad file is a reason for this model, never a crash
        return Unavailable(f"cannot read the tokenizer: {type(e).__name__}: {e}")

"""Chat messages to the text vLLM tokenizes, rendered as vLLM 0.32 renders them.

vLLM turns an OpenAI message list into its "conversation" (renderers/chat_utils.py,
parse_chat_messages) and renders it with transformers' apply_chat_template
(renderers/hf.py, safe_apply_chat_template), whose jinja environment is transformers'
(utils/chat_template_utils.py, _compile_jinja_template): sandboxed, trim_blocks and
lstrip_blocks, the loopcontrols extension and a `{% generation %}` tag, `tojson` without
HTML escaping, `raise_exception` and `strftime_now` as globals, the named special tokens
(bos_token, eos_token, ...) and the caller's keyword arguments in the context. This module
does the same for text messages; a message with an image, audio or video part cannot be
rendered without the engine's processor and is refused (NotText).

`strftime_now` reads the clock in transformers; here the time is passed in (`now`), so the
module stays pure and the caller's clock decides what a date-stamping template writes.

jinja2 is imported where a template is compiled, never at import time: the module loads
without it.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]

# vLLM drops Claude Code's attribution line from system text parts: its value changes on
# every request and would defeat the prefix cache (chat_utils.py, _strip_claude_code_billing_header).
BILLING_HEADER = "x-anthropic-billing-header"
TEXT_PARTS = ("text", "input_text", "output_text", "refusal", "thinking")


class NotText(ValueError):
    """A message the router cannot render as the engine would (media, bad shape)."""


# ---------------------------------------------------------------------------------------------
# The conversation, as parse_chat_messages builds it for text parts


def _part_text(part: object) -> str | None:
    """The text of one content part, None for a part with no content (vLLM skips those)."""
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        raise NotText(f"a content part is a {type(part).__name__}, not an object")
    kind = part.get("type")
    if kind in ("text", "input_text", "output_text"):
        text = part.get("text")
    elif kind == "refusal":
        text = part.get("refusal")
    elif kind == "thinking":
        text = part.get("thinking")
    elif kind is None and "text" in part:
        text = part.get("text")
    else:
        raise NotText(f"a {kind!r} content part is not text")
    if text is None:
        return None
    if not isinstance(text, str):
        raise NotText("a text part's text is not a string")
    return text


def _strip_billing(parts: list[Any]) -> list[Any]:
    out: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else (
            part.get("text") if isinstance(part, Mapping) and part.get("type") == "text" else None)
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _tool_calls(calls: object) -> list[Any] | None:
    """An assistant's tool calls with their JSON arguments parsed into objects, as vLLM
    hands them to templates (chat_utils.py, _postprocess_messages); None: none to keep."""
    if not isinstance(calls, list):
        return None if calls is None else calls  # type: ignore[return-value]
    if not calls:
        return None
    out = []
    for item in calls:
        if not isinstance(item, Mapping) or not isinstance(item.get("function"), Mapping):
            raise NotText("an assistant tool call is not a function call")
        # Keys in the order vLLM's request model leaves them (a template may tojson the
        # whole call): the declared ones first (openai's ChatCompletionMessageToolCallParam:
        # id, function, type; its Function: arguments, name), the others after, as sent.
        function = _declared_first(item["function"], ("arguments", "name"))
        raw = function.get("arguments")
        if not raw:
            function["arguments"] = {}
        elif not isinstance(raw, dict):
            try:
                parsed = json.loads(raw) if isinstance(raw, str) else raw
            except json.JSONDecodeError:
                parsed = None
            function["arguments"] = parsed if isinstance(parsed, dict) else {}
        out.append({**_declared_first(item, ("id", "function", "type")), "function": function})
    return out


def _declared_first(d: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {**{k: d[k] for k in keys if k in d}, **{k: v for k, v in d.items() if k not in keys}}


def conversation(messages: Sequence[Mapping[str, Any]],
                 content_format: ContentFormat) -> list[dict[str, Any]]:
    """vLLM's conversation for text-only OpenAI messages: content as one string (parts
    joined by newlines) for a "string" template, as a list of text parts for an "openai"
    one; name, tool calls (arguments as objects), tool_call_id and reasoning kept."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise NotText("a message is not an object with a role")
        role = message["role"]
        raw = message.get("content")
        parts: list[Any] = [] if raw is None else [raw] if isinstance(raw, str) else raw
        if not isinstance(parts, list):
            raise NotText("a message's content is neither a string nor a list")
        if role == "system":
            parts = _strip_billing(parts)
        texts = [t for t in map(_part_text, parts) if t is not None]
        msg: dict[str, Any] = {"role": role}
        if content_format == "openai":
            msg["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            msg["content"] = "\n".join(texts)
        if role == "assistant":
            if message.get("tool_calls") is not None:
                calls = _tool_calls(message["tool_calls"])
                if calls is not None:
                    msg["tool_calls"] = calls
            if message.get("reasoning") is not None:
                msg["reasoning"] = msg["reasoning_content"] = message["reasoning"]
        elif role == "tool":
            if "tool_call_id" in message:
                msg["tool_call_id"] = message["tool_call_id"]
            if isinstance(msg["content"], list):  # tool results are one string for templates
                msg["content"] = "\n".join(texts)
        if isinstance(message.get("name"), str):
            msg["name"] = message["name"]
        if isinstance(message.get("task"), str):
            msg["task"] = message["task"]
        if role == "developer":
            msg["tools"] = message.get("tools")
        out.append(msg)
    return out


def developer_as_system(conv: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """A template that never names the developer role gets system messages instead, merged
    into one first message (renderers/hf.py, _convert_developer_to_system and
    _consolidate_system_messages)."""
    named = '"developer"' in template or "'developer'" in template
    if named or not any(m["role"] == "developer" for m in conv):
        return conv
    conv = [{**{k: v for k, v in m.items() if k != "tools"}, "role": "system"} if m["role"] == "developer"
            else m for m in conv]
    systems: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(conv):
        if m["role"] != "system":
            rest.append(m)
            continue
        merge = merge or i > 0 or bool(systems)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, Mapping) else p for p in content
                                if isinstance(p, str) or (isinstance(p, Mapping) and "text" in p))
        if content:
            systems.append(content)
    return [{"role": "system", "content": "\n\n".join(systems)}, *rest] if merge else conv


# ---------------------------------------------------------------------------------------------
# The template: transformers' environment, vLLM's content-format detection


def _environment() -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for transformers'
        assistant mask; rendering writes the body unchanged."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def _is_name(node: Any, name: str) -> bool:
    import jinja2.nodes as n

    return isinstance(node, n.Name) and node.ctx == "load" and node.name == name


def _is_access(node: Any, name: str, key: str | None = None) -> bool:
    """`name`, `name[...]`, `name.key`, `name['key']`, through filters, tests and slices
    (renderers/hf.py, _is_var_or_elems_access)."""
    import jinja2.nodes as n

    if isinstance(node, n.Filter):
        return node.node is not None and _is_access(node.node, name, key)
    if isinstance(node, n.Test):
        return _is_access(node.node, name, key)
    if isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
        return _is_access(node.node, name, key)
    if key is None:
        return _is_name(node, name)
    if isinstance(node, n.Getitem):
        return _is_name(node.node, name) and isinstance(node.arg, n.Const) and node.arg.value == key
    return isinstance(node, n.Getattr) and _is_name(node.node, name) and node.attr == key


def _aliases(root: Any, name: str) -> Iterator[str]:
    import jinja2.nodes as n

    yield name
    todo = deque([name])
    while todo:
        current = todo.popleft()
        for assign in root.find_all(n.Assign):
            if _is_access(assign.node, current) and isinstance(assign.target, n.Name):
                yield assign.target.name
                if assign.target.name != current:
                    todo.append(assign.target.name)


def _loops_over_content(root: Any) -> bool:
    """Whether the template loops over a message's content (vLLM's "openai" format):
    renderers/hf.py, _iter_nodes_assign_content_item, macros included."""
    import jinja2.nodes as n

    messages = list(_aliases(root, "messages"))
    items = [loop.target.name for loop in root.find_all(n.For)
             if isinstance(loop.target, n.Name) and any(_is_access(loop.iter, m) for m in messages)]
    by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(n.Macro):
        names = {a.name for a in macro.args}
        params: set[str] = set()
        for call in root.find_all(n.Call):
            if isinstance(call.node, n.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(macro.args) and any(_is_access(arg, v, "content") for v in items):
                        params.add(macro.args[i].name)
                for kw in call.kwargs:
                    if kw.key in names and any(_is_access(kw.value, v, "content") for v in items):
                        params.add(kw.key)
        for loop in macro.find_all(n.For):
            in_macros.add(id(loop))
            if params:
                by_loop[id(loop)] = params
    for loop in root.find_all(n.For):
        if any(_is_access(loop.iter, v, "content") for v in items):
            return True
        if isinstance(loop.iter, n.Name) and (
                loop.iter.name in by_loop.get(id(loop), ())
                or (id(loop) not in in_macros and loop.iter.name == "content")):
            return True
    return False


class Template:
    """One compiled chat template and what vLLM detects from it."""

    def __init__(self, source: str) -> None:
        self.source = source
        env = _environment()
        self._compiled = env.from_string(source)
        try:
            loops = _loops_over_content(env.parse(source))
            self.content_format: ContentFormat = "openai" if loops else "string"
        except Exception:  # vLLM falls back to "string" when the AST walk fails
            self.content_format = "string"

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
               continue_final_message: bool, special_tokens: Mapping[str, str],
               now: datetime, tools: list[Any] | None = None, documents: list[Any] | None = None,
               kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text: transformers' render_jinja_template for one conversation."""
        conv = developer_as_system(conversation(messages, self.content_format), self.source)
        if not conv:
            raise NotText("an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise NotText("continue_final_message and add_generation_prompt together")
        tag = "CONTINUE_FINAL_MESSAGE_TAG "
        final = ""
        if continue_final_message:
            last = conv[-1] = dict(conv[-1])
            content = last.get("content")
            if isinstance(content, list):
                texts = [p for p in content if "text" in p]
                if not texts:
                    raise NotText("no text to continue in the final message")
                final = texts[-1]["text"]
                texts[-1]["text"] = final + tag
            elif isinstance(content, str):
                final = content
                last["content"] = content + tag
            else:
                raise NotText("the final message has no content to continue")
        context = {**special_tokens, **(kwargs or {})}
        for key in ("messages", "tools", "documents", "add_generation_prompt"):
            context.pop(key, None)
        # transformers' strftime_now is a global reading the clock; a context entry of the
        # same name reads the time the caller passed, and leaves the template thread-safe.
        context["strftime_now"] = now.strftime
        text: str = self._compiled.render(messages=conv, tools=tools, documents=documents,
                                          add_generation_prompt=add_generation_prompt, **context)
        if continue_final_message:
            if final.strip() not in text or tag.strip() not in text:
                raise NotText("the template drops part of the final message")
            at = text.rindex(tag.strip())
            text = text[:at] if text[at:at + len(tag)] == tag else text[:at].rstrip()
        return text

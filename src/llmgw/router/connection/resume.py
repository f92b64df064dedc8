"""Mid-stream failover, pure: what a stream already gave the client, and the request that
has another replica go on from there.

When an engine dies after the client got part of a streamed answer, the router may ask
another replica for the rest: the same request, with what was already sent added to the
prompt. `refusal` says whether a request may be resumed at all; `Stream` reads each event
the client gets (its text, its id, how many tokens it holds), builds the continuation's
body (`next_body`) and rewrites the continuation's events (`rewrite`), so that the client
sees one answer; `Follow` is the same at the level of the engine's HTTP chunks.

What the engine reads (vLLM 0.32, vllm/entrypoints/...):
- A completion goes on with `prompt` = the prompt + the text sent. `echo` would send the
  prompt again (openai/completion/protocol.py:59), so it is refused, as are token-id
  prompts (the text sent has no ids here) and several prompts (one stream per prompt).
  `max_tokens` defaults to 16 there (openai/completion/protocol.py:63).
- A chat goes on with the messages + a final assistant message holding the text sent,
  `continue_final_message: true` and `add_generation_prompt: false`: the template leaves
  that message open and the model continues it (openai/chat_completion/protocol.py:319,
  327; both true at once is refused by check_generation_prompt, :1023-1030). A client
  that prefilled the assistant turn itself (`continue_final_message` already) has the
  text appended to that message. `echo` there (:312) repeats that final message: refused.
- The continuation asks `stream_options: {include_usage: true, continuous_usage_stats:
  true}` (StreamOptions, generate/base/protocol.py:293-295; honoured only with
  include_usage, serve/utils/api_utils.py:289): each of its chunks then carries the
  running `completion_tokens` (openai/completion/serving.py:433), so what a continuation
  sent is counted exactly.
SGLang 0.5.23 reads the same fields (srt/entrypoints/openai/protocol.py:1013
continue_final_message, :232-234 StreamOptions.continuous_usage_stats; serving_chat.py:519
opens the final assistant message).

Counting what the first engine sent, which was not asked for usage per chunk: vLLM writes
one event per output it hands its API server (openai/completion/serving.py, the loop over
`res.outputs`; chat likewise, after its role chunk). An output is one engine step, one
token without speculative decoding and with the default stream interval, more with
either; and when the API server falls behind the engine, the outputs of several steps are
merged into one (v1/engine/output_processor.py:53-79, RequestOutputCollector.put; seen
with the CPU build on a loaded machine: a stream of 300 tokens, ignore_eos, came in 296
events). So the count of events is a floor,
not the number of tokens: a continuation's `max_tokens` is the original less that floor,
and the whole answer may run past the client's limit, and its usage count fewer
completion tokens than it held, by what was merged or speculated before the break. Where
the client asked for `continuous_usage_stats` itself the engine's own count is used.

Refused (the stream ends with the error event, as without failover): n or best_of above 1,
logprobs, a pinned seed (the client wants that exact sample, and a second engine would
not give it), echo, beam search, structured output (the grammar would start over), and at
run time a tool call, reasoning text, a second choice, an error event, or a break inside an
event. The client sees one answer: every event carries the first engine's id and created;
the continuation's role chunk is dropped; the final usage counts the original prompt (the
continuation's prompt tokens less the tokens sent) and the completion tokens summed over
the replicas; one [DONE].
"""

from __future__ import annotations

import json
import re
from typing import Any

from llmgw.http1.writers import chunk

KINDS = {b"/v1/completions": "completion", b"/v1/chat/completions": "chat"}
# vLLM's CompletionRequest.max_tokens default (openai/completion/protocol.py:63).
COMPLETION_MAX_TOKENS = 16
# A chunk larger than this is not held whole: the stream is then passed on as it comes and
# can no longer be resumed (an engine writes one small event per chunk).
HOLD_MAX = 1 << 20
# SGLang's own structured-output fields (srt/entrypoints/openai/protocol.py:401-402 for
# completions, :1006-1007 for chat).
SGLANG_GRAMMARS = ("regex", "ebnf")
_COMPACT = (",", ":")
# The usual event of a stream under way, as vLLM writes it (pydantic's compact JSON): one
# choice, index 0, text (completion) or a content-only delta (chat), no logprobs, no
# finish, nothing after the choices (no usage). Read without parsing the whole event (a
# few µs less per event on every resumable stream); anything else is parsed as JSON.
_CHOICES = b'"choices":['
_USUAL = re.compile(rb'\{"index":0,"(?:text|delta":\{"content)":"((?:[^"\\]|\\.)*)"\}?,'
                    rb'"logprobs":null,"finish_reason":null(?:,"stop_reason":null)?\}\]\}\s*$')


def refusal(path: bytes, body: dict[str, Any]) -> str | None:
    """Why a stream of this request cannot go on on another replica; None when it can."""
    kind = KINDS.get(path)
    if kind is None:
        return "not a completion or chat request"
    if body.get("stream") is not True:
        return "not streamed"
    for key in ("n", "best_of"):
        v = body.get(key)
        if v is not None and v != 1:
            return f"{key} is {v!r}"
    if body.get("seed") is not None:
        return "a seed is pinned"
    if body.get("echo"):
        return "echo"
    if body.get("use_beam_search"):
        return "beam search"
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    fmt = body.get("response_format")
    if (fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text")) or \
            body.get("structured_outputs") is not None:
        return "structured output"
    if any(k.startswith("guided_") for k in body) or any(body.get(k) for k in SGLANG_GRAMMARS):
        return "structured output"
    if kind == "completion":
        if body.get("logprobs") is not None:
            return "logprobs"
        prompt = body.get("prompt")
        if not (isinstance(prompt, str)
                or (isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str))):
            return "the prompt is not one text"
        return None
    if body.get("logprobs") or body.get("top_logprobs"):
        return "logprobs"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "no messages"
    if body.get("continue_final_message"):
        last = messages[-1]
        if not (isinstance(last, dict) and last.get("role") == "assistant"
                and isinstance(last.get("content"), str)):
            return "the final message to continue is not an assistant's text"
    return None


def _limit(value: Any, used: int) -> Any:
    return value - used if isinstance(value, int) and not isinstance(value, bool) else value


class Stream:
    """One streamed answer as the client gets it, from however many replicas.

    `body`: the client's request (parsed). `usage_event`: the request sent to the first
    engine asked for the usage event (the client did, or the router did to meter it: the
    usage tap after this reads it, and takes it out where the client had not asked).
    """

    def __init__(self, kind: str, body: dict[str, Any], usage_event: bool) -> None:
        self.kind = kind
        self.body = body
        self.usage_event = usage_event
        opts = body.get("stream_options")
        # The client's own ask for usage in every chunk: kept, with the summed counts.
        self.continuous = (isinstance(opts, dict) and opts.get("include_usage") is True
                           and opts.get("continuous_usage_stats") is True)
        self.id: Any = None
        self.created: Any = None
        self.text: list[str] = []
        self.part = 0  # 0: the first replica's answer; k: the k-th continuation
        self.base = 0  # completion tokens sent before this part
        self.steps = 0  # this part's events with a choice (a floor of its tokens)
        self.exact: int | None = None  # this part's tokens, by the engine's own count
        self.prompt: int | None = None  # the original prompt's tokens, once known
        self.role = False  # the chat role chunk went to the client
        self.finished = False  # a finish_reason went to the client
        self.done = False  # [DONE] went to the client
        self.why_not = ""  # why it can no longer be resumed

    # ---- reading -----------------------------------------------------------------------

    @property
    def sent_tokens(self) -> int:
        """Completion tokens the client got so far (a floor for an uncounted part)."""
        return self.base + (self.exact if self.exact is not None else self.steps)

    def _parse(self, ev: bytes) -> Any:
        data = ev.strip()
        if not data.startswith(b"data:"):
            if not data or data.startswith(b":"):
                return None  # an SSE comment or an empty event: nothing said
            self.why_not = "an event that is not data"
            return None
        data = data[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return None
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            self.why_not = "an event that is not JSON"
            return None
        if not isinstance(obj, dict):
            self.why_not = "an event that is not a JSON object"
            return None
        if "error" in obj:
            self.why_not = "the engine sent an error"
        return obj

    def observe(self, ev: bytes) -> None:
        """One event of the first replica's answer, as the client gets it."""
        if self.id is not None:
            at = ev.find(_CHOICES)
            m = _USUAL.match(ev, at + len(_CHOICES)) if at > 0 else None
            if m is not None:
                raw = m.group(1)
                text = json.loads(b'"%s"' % raw) if b"\\" in raw else raw.decode("utf-8", "replace")
                if text:
                    self.text.append(text)
                self.steps += 1
                return
        obj = self._parse(ev)
        if obj is not None:
            if self.id is None:
                self.id, self.created = obj.get("id"), obj.get("created")
            self.role = self._read(obj) or self.role

    def _read(self, obj: dict[str, Any]) -> bool:
        """Take in an event's text, tokens and usage; True for the chat role chunk alone
        (no text, no finish)."""
        usage = obj.get("usage")
        if isinstance(usage, dict):
            c, p = usage.get("completion_tokens"), usage.get("prompt_tokens")
            if isinstance(c, int) and not isinstance(c, bool):
                self.exact = c
            if isinstance(p, int) and not isinstance(p, bool) and self.prompt is None:
                # A continuation's prompt holds the text sent: its tokens less those.
                self.prompt = max(0, p - self.base) if self.part else p
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices:
            return False
        role_only = False
        for c in choices:
            if not isinstance(c, dict) or c.get("index", 0) != 0:
                self.why_not = "more than one choice"
                continue
            if c.get("finish_reason") is not None:
                self.finished = True
            if self.kind == "completion":
                text = c.get("text")
            else:
                delta = c.get("delta")
                if not isinstance(delta, dict):
                    delta = {}
                if delta.get("tool_calls"):
                    self.why_not = "a tool call started"
                if delta.get("reasoning") or delta.get("reasoning_content"):
                    self.why_not = "reasoning text was sent"
                text = delta.get("content")
                if "role" in delta and not text and c.get("finish_reason") is None:
                    role_only = True
                    continue
            if isinstance(text, str) and text:
                self.text.append(text)
            self.steps += 1
        return role_only

    # ---- going on ------------------------------------------------------------------------

    def resumable(self) -> str | None:
        """Why the stream cannot go on now; None when it can (or has nothing left but
        its end: `finished`)."""
        if self.why_not:
            return self.why_not
        if self.done:
            return "the answer was whole"
        return None

    def next_body(self) -> bytes | None:
        """The request for the next replica, from what the client got; None when the
        token limit is used up (nothing is left to ask for)."""
        body = dict(self.body)
        used = self.sent_tokens
        emitted = "".join(self.text)
        opts = body.get("stream_options")
        opts = dict(opts) if isinstance(opts, dict) else {}
        opts["include_usage"] = True
        opts["continuous_usage_stats"] = True
        body["stream_options"] = opts
        if self.kind == "completion":
            limit = body.get("max_tokens", COMPLETION_MAX_TOKENS)
            if isinstance(limit, int) and limit - used < 1:
                return None
            body["max_tokens"] = _limit(limit, used)
            prompt = body["prompt"]
            body["prompt"] = prompt + emitted if isinstance(prompt, str) else [prompt[0] + emitted]
        else:
            for key in ("max_tokens", "max_completion_tokens"):
                limit = body.get(key)
                if isinstance(limit, int) and not isinstance(limit, bool):
                    if limit - used < 1:
                        return None
                    body[key] = limit - used
            messages = list(body["messages"])
            if body.get("continue_final_message"):
                last = dict(messages[-1])
                last["content"] = last["content"] + emitted
                messages[-1] = last
            elif emitted:
                messages.append({"role": "assistant", "content": emitted})
                body["continue_final_message"] = True
                body["add_generation_prompt"] = False
            body["messages"] = messages
        if isinstance(body.get("min_tokens"), int):
            body["min_tokens"] = max(0, body["min_tokens"] - used)
        self.base = used
        self.part += 1
        self.steps = 0
        self.exact = None
        return json.dumps(body, separators=_COMPACT, ensure_ascii=False).encode()

    def _usage(self, obj: dict[str, Any]) -> dict[str, Any]:
        prompt = self.prompt or 0
        completion = self.sent_tokens
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                "completion_tokens": completion}

    def rewrite(self, ev: bytes) -> bytes:
        """One event of a continuation, as the client is to get it (b"": dropped)."""
        if not ev.strip():
            return b""
        obj = self._parse(ev)
        if obj is None:
            return ev  # [DONE], a comment (or what made it unresumable): as it came
        if "error" in obj:
            return ev
        if self.id is None:  # the first replica sent its head and no event
            self.id, self.created = obj.get("id"), obj.get("created")
        role_only = self._read(obj)
        if role_only and self.role:
            return b""  # the client had its role chunk from the first replica
        self.role = self.role or role_only
        if self.id is not None and "id" in obj:
            obj["id"] = self.id
        if self.created is not None and "created" in obj:
            obj["created"] = self.created
        if self.kind == "chat":
            for c in obj.get("choices") or ():
                if isinstance(c, dict) and isinstance(c.get("delta"), dict):
                    c["delta"].pop("role", None)
        if "usage" in obj:
            if not obj.get("choices"):  # the usage event, after the last choice
                if not self.usage_event:
                    return b""
                obj["usage"] = self._usage(obj)
            elif self.continuous:
                obj["usage"] = self._usage(obj)
            else:
                del obj["usage"]
        return b"data: " + json.dumps(obj, separators=_COMPACT, ensure_ascii=False).encode() + b"\n\n"


class Follow:
    """A resumable stream's chunks on their way to the client. Whole chunks only go on (a
    partial one is held, and dropped when the engine breaks), so the client is at a chunk's
    edge when another replica takes over. The first replica's chunks go byte for byte and
    their events are read; a continuation's events are rewritten (`Stream.rewrite`) and sent
    one chunk per engine chunk."""

    __slots__ = ("stream", "_held", "_event", "off")

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self._held = b""  # an incomplete chunk
        self._event = b""  # the start of an event whose end is in a later chunk
        self.off = False  # a chunk too large to hold: passed on as it comes from then on

    @property
    def at_edge(self) -> bool:
        """The client got no part of an event (what the first replica sent is whole)."""
        return not self.off and (self.stream.part > 0 or not self._event)

    def restart(self) -> None:
        """A new replica takes over: what was held of the broken one is dropped."""
        self._held = b""
        self._event = b""

    def feed(self, data: bytes) -> bytes:
        """What of `data` (the engine's chunks, framing checked) goes to the client now."""
        if self.off:
            return data
        buf = self._held + data if self._held else data
        out = bytearray()
        pos = 0
        n = len(buf)
        while pos < n:
            nl = buf.find(b"\r\n", pos)
            if nl < 0:
                break
            size = int(buf[pos:nl].split(b";", 1)[0], 16)  # the relay's reader checked it
            end = nl + 2 + size + 2
            if end > n:
                break
            self._events(buf, nl + 2, end - 2, pos, end, out)
            pos = end
        rest = buf[pos:]
        if len(rest) > HOLD_MAX:
            self.off = True
            self.stream.why_not = "a chunk too large to hold"
            out += rest
            rest = b""
        self._held = rest
        return bytes(out)

    def _events(self, buf: bytes, start: int, stop: int, at: int, end: int, out: bytearray) -> None:
        payload = buf[start:stop]
        if self._event:
            payload = self._event + payload
        events = payload.split(b"\n\n")
        self._event = events.pop()  # b"" when the chunk ends with an event's end
        s = self.stream
        if s.part == 0:
            for ev in events:
                s.observe(ev)
            out += buf[at:end]
            return
        kept = b"".join(r for ev in events if (r := s.rewrite(ev + b"\n\n")))
        out += chunk(kept)

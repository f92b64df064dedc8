"""Mid-stream failover's pure core (router/connection/resume.py): which requests may be
resumed, the continuation's body, and the client's one answer from two engines."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.http1.chunked import dechunk
from llmgw.http1.writers import chunk
from llmgw.router.connection.resume import KINDS, Follow, Stream, refusal
from llmgw.router.tenants.usage import UsageTap

COMP = b"/v1/completions"
CHAT = b"/v1/chat/completions"


def vllm_events(kind: str, rid: str, tokens: list[str], prompt_tokens: int, *,
                continuous: bool = False, usage: bool = True, created: int = 1,
                spaced: bool = False) -> list[bytes]:
    """A stream as vLLM 0.32 writes it (pydantic's compact JSON, UTF-8 as it is; `spaced`:
    json.dumps' default, as another server may write it): chat starts with a role chunk;
    one event per token; the last carries the finish_reason; the usage event when asked;
    [DONE]."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def ev(choices: list[dict[str, Any]], n: int | None) -> bytes:
        payload: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": "m",
                                   "choices": choices}
        if n is not None:
            payload["usage"] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n,
                                "completion_tokens": n}
        dumped = json.dumps(payload) if spaced else json.dumps(payload, separators=(",", ":"),
                                                               ensure_ascii=False)
        return b"data: " + dumped.encode() + b"\n\n"

    out = []
    if kind == "chat":
        out.append(ev([{"index": 0, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}], 0 if continuous else None))
    for i, t in enumerate(tokens):
        fin = "length" if i == len(tokens) - 1 else None
        c: dict[str, Any] = ({"index": 0, "delta": {"content": t}, "logprobs": None, "finish_reason": fin}
                             if kind == "chat" else
                             {"index": 0, "text": t, "logprobs": None, "finish_reason": fin})
        out.append(ev([c], i + 1 if continuous else None))
    if usage:
        out.append(ev([], len(tokens)))
    out.append(b"data: [DONE]\n\n")
    return out


def texts(kind: str, events: list[bytes]) -> tuple[str, list[dict[str, Any]]]:
    text = ""
    objs = []
    for ev in events:
        data = ev.strip()[5:].strip()
        if data == b"[DONE]":
            continue
        o = json.loads(data)
        objs.append(o)
        for c in o["choices"]:
            text += (c.get("text") or "") if kind == "completion" else (c["delta"].get("content") or "")
    return text, objs


def split_events(payload: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in payload.split(b"\n\n") if e]


def body_of(kind: str, limit: int, **extra: Any) -> dict[str, Any]:
    if kind == "chat":
        return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "max_tokens": limit, **extra}
    return {"model": "m", "prompt": "Once", "stream": True, "max_tokens": limit, **extra}


@pytest.mark.parametrize(("path", "body", "why"), [
    (COMP, {"prompt": "a", "stream": True}, None),
    (CHAT, {"messages": [{"role": "user", "content": "a"}], "stream": True}, None),
    (COMP, {"prompt": ["a"], "stream": True, "n": 1, "seed": None}, None),
    (COMP, {"prompt": "a"}, "not streamed"),
    (b"/v1/embeddings", {"input": "a", "stream": True}, "not a completion or chat request"),
    (COMP, {"prompt": "a", "stream": True, "n": 2}, "n is 2"),
    (COMP, {"prompt": "a", "stream": True, "best_of": 3}, "best_of is 3"),
    (COMP, {"prompt": "a", "stream": True, "seed": 7}, "a seed is pinned"),
    (COMP, {"prompt": "a", "stream": True, "echo": True}, "echo"),
    (COMP, {"prompt": "a", "stream": True, "logprobs": 0}, "logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}], "stream": True, "logprobs": True}, "logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}], "stream": True, "top_logprobs": 2}, "logprobs"),
    (COMP, {"prompt": "a", "stream": True, "use_beam_search": True}, "beam search"),
    (COMP, {"prompt": "a", "stream": True, "response_format": {"type": "json_object"}}, "structured output"),
    (COMP, {"prompt": "a", "stream": True, "response_format": {"type": "text"}}, None),
    (COMP, {"prompt": "a", "stream": True, "guided_json": {}}, "structured output"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}], "stream": True, "regex": "a+"},
     "structured output"),
    (COMP, {"prompt": [1, 2], "stream": True}, "the prompt is not one text"),
    (COMP, {"prompt": ["a", "b"], "stream": True}, "the prompt is not one text"),
    (CHAT, {"messages": [], "stream": True}, "no messages"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}], "stream": True,
            "continue_final_message": True}, "the final message to continue is not an assistant's text"),
])
def test_refusal(path: bytes, body: dict[str, Any], why: str | None) -> None:
    assert refusal(path, body) == why


def relay(kind: str, body: dict[str, Any], first: list[bytes], cut: int, second: list[bytes],
          usage_event: bool = True, reads: int = 1) -> tuple[Stream, bytes, bytes]:
    """The first engine's events up to `cut` (then it breaks inside the next chunk), the
    continuation's body, and the continuation's events: what the client got, whole."""
    s = Stream(kind, body, usage_event)
    f = Follow(s)
    wire = b"".join(chunk(e) for e in first)
    # Everything up to `cut` events, and half of the next chunk, in `reads` pieces.
    upto = len(b"".join(chunk(e) for e in first[:cut]))
    nxt = len(chunk(first[cut])) // 2 if cut < len(first) else 0
    sent = wire[:upto + nxt]
    out = b""
    step = max(1, len(sent) // reads)
    for i in range(0, len(sent), step):
        out += f.feed(sent[i:i + step])
    assert f.at_edge
    assert s.resumable() is None
    nb = s.next_body()
    assert nb is not None
    f.restart()
    out += f.feed(b"".join(chunk(e) for e in second))
    return s, nb, dechunk(out + b"0\r\n\r\n")


TOKENS = ["The", " cat", " sat", " on", " the", " mat", ".", " It", " purred", "!"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("cut_tokens", [0, 1, 4, 9])
def test_one_answer_from_two_engines(kind: str, cut_tokens: int) -> None:
    body = body_of(kind, 10)
    first = vllm_events(kind, "first", TOKENS, 7, created=111)
    lead = 1 if kind == "chat" else 0  # the role chunk
    cut = lead + cut_tokens
    sent = "".join(TOKENS[:cut_tokens])
    rest = TOKENS[cut_tokens:]
    # The continuation's prompt holds what was sent: 7 + cut_tokens tokens.
    second = vllm_events(kind, "second", rest, 7 + cut_tokens, continuous=True, created=222)
    s, nb, payload = relay(kind, body, first, cut, second)
    req = json.loads(nb)
    assert req["max_tokens"] == 10 - cut_tokens
    assert req["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    if kind == "completion":
        assert req["prompt"] == "Once" + sent
    elif sent:
        assert req["messages"][-1] == {"role": "assistant", "content": sent}
        assert req["continue_final_message"] is True
        assert req["add_generation_prompt"] is False
    else:  # nothing sent yet: the original request again
        assert req["messages"] == body["messages"]
        assert "continue_final_message" not in req
    text, objs = texts(kind, split_events(payload))
    assert text == "".join(TOKENS)
    # One id and created: the first engine's, or the continuation's where no event of the
    # first one went out.
    assert {(o["id"], o["created"]) for o in objs} == {("first", 111) if cut else ("second", 222)}
    if kind == "chat":
        roles = [o for o in objs if o["choices"] and "role" in o["choices"][0]["delta"]]
        assert len(roles) == 1
    usages = [o["usage"] for o in objs if "usage" in o]
    assert usages == [{"prompt_tokens": 7, "total_tokens": 17, "completion_tokens": 10}]
    assert payload.count(b"[DONE]") == 1


def test_prefilled_assistant_message_grows() -> None:
    body = {"model": "m", "stream": True, "continue_final_message": True, "add_generation_prompt": False,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure:"}]}
    first = vllm_events("chat", "a", [" one", " two"], 5)
    s = Stream("chat", body, False)
    for e in first[:2]:
        s.observe(e)
    req = json.loads(s.next_body() or b"")
    assert req["messages"] == [{"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "Sure: one"}]
    assert "max_tokens" not in req and "max_completion_tokens" not in req


def test_usage_event_dropped_where_nobody_asked_and_kept_per_chunk_where_the_client_did() -> None:
    first = vllm_events("completion", "a", TOKENS, 3, usage=False)
    second = vllm_events("completion", "b", TOKENS[2:], 5, continuous=True)
    _, _, payload = relay("completion", body_of("completion", 10), first, 2, second, usage_event=False)
    assert b'"usage"' not in payload
    opts = {"include_usage": True, "continuous_usage_stats": True}
    first = vllm_events("completion", "a", TOKENS, 3, continuous=True)
    s, _, payload = relay("completion", body_of("completion", 10, stream_options=opts), first, 2, second)
    assert s.prompt == 3  # the engine's own count, read from the first engine's chunks
    _, objs = texts("completion", split_events(payload))
    got = [o["usage"]["completion_tokens"] for o in objs]
    assert got == list(range(1, 11)) + [10]  # the first engine's, then summed
    assert {o["usage"]["prompt_tokens"] for o in objs} == {3}


def test_token_limit_used_up_and_counts_in_steps() -> None:
    s = Stream("completion", {"prompt": "x", "stream": True}, False)  # vLLM's default: 16
    for e in vllm_events("completion", "a", ["a"] * 16, 1)[:16]:
        s.observe(e)
    assert s.sent_tokens == 16
    assert s.next_body() is None
    s = Stream("chat", body_of("chat", 100, min_tokens=5, max_completion_tokens=50), False)
    for e in vllm_events("chat", "a", ["a", "b", "c"], 1)[:4]:
        s.observe(e)
    req = json.loads(s.next_body() or b"")
    assert (req["max_tokens"], req["max_completion_tokens"], req["min_tokens"]) == (97, 47, 2)


@pytest.mark.parametrize(("delta", "why"), [
    ({"tool_calls": [{"index": 0, "function": {"name": "f"}}]}, "a tool call started"),
    ({"reasoning": "hmm"}, "reasoning text was sent"),
    ({"reasoning_content": "hmm"}, "reasoning text was sent"),
])
def test_runtime_refusals(delta: dict[str, Any], why: str) -> None:
    s = Stream("chat", body_of("chat", 10), False)
    s.observe(b'data: {"id":"a","created":1,"choices":[{"index":0,"delta":%s}]}\n\n'
              % json.dumps(delta).encode())
    assert s.resumable() == why


def test_other_runtime_states() -> None:
    s = Stream("completion", body_of("completion", 10), False)
    assert s.resumable() is None  # a head and no event yet: the request again
    s.observe(b'data: {"id":"a","choices":[{"index":1,"text":"x"}]}\n\n')
    assert s.resumable() == "more than one choice"
    s = Stream("completion", body_of("completion", 10), False)
    s.observe(b'data: {"error":{"message":"boom"}}\n\n')
    assert s.resumable() == "the engine sent an error"
    s = Stream("completion", body_of("completion", 10), False)
    s.observe(b"data: {nope\n\n")
    assert s.resumable() == "an event that is not JSON"
    s = Stream("completion", body_of("completion", 10), False)
    s.observe(b'data: {"id":"a","choices":[{"index":0,"text":"x","finish_reason":"stop"}]}\n\n')
    s.observe(b"data: [DONE]\n\n")
    assert s.finished and s.resumable() == "the answer was whole"


def test_follow_holds_partial_chunks_and_knows_a_split_event() -> None:
    s = Stream("completion", body_of("completion", 10), False)
    f = Follow(s)
    ev = vllm_events("completion", "a", ["x"], 1)[0]
    wire = chunk(ev)
    assert f.feed(wire[:5]) == b""
    assert f.feed(wire[5:]) == wire
    assert f.at_edge and s.text == ["x"]
    # An event cut in two chunks: the client got half of it.
    assert f.feed(chunk(ev[:10])) == chunk(ev[:10])
    assert not f.at_edge
    assert f.feed(chunk(ev[10:])) == chunk(ev[10:])
    assert f.at_edge and s.text == ["x", "x"]


def test_kinds_are_the_proxied_generation_paths() -> None:
    assert set(KINDS) == {COMP, CHAT}


@given(
    kind=st.sampled_from(["completion", "chat"]),
    tokens=st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=30),
    spaced=st.booleans(),
    data=st.data(),
)
def test_any_split_gives_the_whole_answer(kind: str, tokens: list[str], spaced: bool,
                                          data: st.DataObject) -> None:
    k = data.draw(st.integers(0, len(tokens) - 1))
    reads = data.draw(st.integers(1, 7))
    limit = len(tokens) + data.draw(st.integers(0, 3))
    body = body_of(kind, limit)
    first = vllm_events(kind, "first", tokens, 4, created=5, spaced=spaced)
    second = vllm_events(kind, "second", tokens[k:], 4 + k, continuous=True, created=6, spaced=spaced)
    lead = 1 if kind == "chat" else 0
    s, nb, payload = relay(kind, body, first, lead + k, second, reads=reads)
    req = json.loads(nb)
    sent = "".join(tokens[:k])
    if kind == "completion":
        assert req["prompt"] == "Once" + sent
    elif sent:
        assert req["messages"][-1]["content"] == sent
    assert req["max_tokens"] == limit - k
    text, objs = texts(kind, split_events(payload))
    assert text == "".join(tokens)
    assert {(o["id"], o["created"]) for o in objs} == {("first", 5) if lead + k else ("second", 6)}
    assert [o["usage"] for o in objs if "usage" in o] == [
        {"prompt_tokens": 4, "total_tokens": 4 + len(tokens), "completion_tokens": len(tokens)}]


def test_metered_stream_is_charged_once_for_what_the_client_got() -> None:
    """The usage tap after the follower (as the relay chains them): the router asked the
    first engine for usage to meter it, the client did not; the tap reads the one summed
    usage and takes its event out."""
    tap = UsageTap(True, strip=True)
    tap.chunked = True
    s = Stream("completion", body_of("completion", 10), usage_event=True)
    f = Follow(s)
    first = vllm_events("completion", "a", TOKENS, 6)
    out = tap.feed(f.feed(b"".join(chunk(e) for e in first[:4])))
    assert s.next_body() is not None
    f.restart()
    out += tap.feed(f.feed(b"".join(chunk(e) for e in vllm_events("completion", "b", TOKENS[4:], 10,
                                                                   continuous=True))))
    tap.done()
    assert (tap.prompt, tap.completion, tap.seen) == (6, 10, True)
    payload = dechunk(out + b"0\r\n\r\n")
    assert b'"usage"' not in payload
    assert texts("completion", split_events(payload))[0] == "".join(TOKENS)

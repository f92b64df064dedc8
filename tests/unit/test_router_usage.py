"""Usage metering in the router (issue 24): the tap that reads an answer's `usage` (and
strips a stream's usage event the client did not ask for), the meter's batches (a retry
keeps its id), the server adding a batch once, and `ctl usage` rendering."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.cli import build_parser
from llmgw.ctl import usage as ctl_usage
from llmgw.model.usage import UsageRow
from llmgw.router.tenants.usage import UsageMeter, UsageTap, read_usage, with_usage
from llmgw.server.peers.sessions import Peer
from llmgw.server.store.sql import Store
from llmgw.server.tenants.apikeys import ApiKeys
from llmgw.transport.apikey_ops import UsageOp, UsageReportOp


def event(obj: dict[str, Any]) -> bytes:
    payload = b"data: " + json.dumps(obj).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(payload), payload)


TOKENS = [event({"choices": [{"text": t}]}) for t in ("a", "b", "c")]
USAGE = event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3,
                                        "total_tokens": 10}})
DONE = b"e\r\ndata: [DONE]\n\n\r\n"
WIRE = b"".join(TOKENS) + USAGE + DONE


def relay(tap: UsageTap, wire: bytes, cuts: list[int]) -> bytes:
    tap.chunked = True
    out = b""
    last = 0
    for c in sorted(set(cuts)) + [len(wire)]:
        out += tap.feed(wire[last:c])
        last = c
    tap.done()
    return out


@given(st.lists(st.integers(0, len(WIRE)), max_size=8))
def test_stream_usage_is_read_and_stripped_however_the_bytes_come(cuts: list[int]) -> None:
    tap = UsageTap(stream=True, strip=True)
    assert relay(tap, WIRE, cuts) == b"".join(TOKENS) + DONE
    assert (tap.prompt, tap.completion, tap.seen) == (7, 3, True)
    kept = UsageTap(stream=True, strip=False)
    assert relay(kept, WIRE, cuts) == WIRE  # the client asked for it: byte for byte
    assert (kept.prompt, kept.completion) == (7, 3)


def test_stream_usage_at_every_single_cut() -> None:
    # Every place one read can end (hypothesis above draws several cuts, and may miss one
    # place: a first read of "24\r" once went out whole, its chunk not yet seen).
    for cut in range(len(WIRE) + 1):
        tap = UsageTap(True, True)
        assert relay(tap, WIRE, [cut]) == b"".join(TOKENS) + DONE, cut
        assert (tap.prompt, tap.completion, tap.seen) == (7, 3, True), cut


def test_a_huge_chunk_is_not_held() -> None:
    big = event({"choices": [{"text": "x" * 100_000}]})
    tap = UsageTap(stream=True, strip=True)
    tap.chunked = True
    first = tap.feed(big[:1000])
    assert first == big[:1000]  # passed on at once
    assert tap.feed(big[1000:] + USAGE) == big[1000:]
    assert tap.completion == 3


def test_plain_answer_usage_from_its_tail() -> None:
    body = json.dumps({"choices": [{"text": "x" * 10_000}],
                       "usage": {"prompt_tokens": 11, "completion_tokens": 5}}).encode()
    tap = UsageTap(stream=False)
    assert tap.feed(body[:50]) + tap.feed(body[50:]) == body
    tap.done()
    assert (tap.prompt, tap.completion) == (11, 5)
    junk = UsageTap(stream=False)
    junk.feed(b'{"usage": {"prompt_tokens": -1}}')
    junk.done()
    assert not junk.seen


COUNT = st.integers(0, 10**9)
DETAILS = st.one_of(st.none(), st.fixed_dictionaries({"cached_tokens": COUNT}),
                    st.fixed_dictionaries({"cached_tokens": COUNT,
                                           "multimodal_tokens": st.dictionaries(
                                               st.sampled_from(["image", "audio"]), COUNT)}))


@st.composite
def usage_objects(draw: st.DrawFn) -> tuple[dict[str, Any], int, int]:
    """A usage object as an engine may write it: vLLM's and SGLang's field order (prompt,
    total, completion, details), OpenAI's (prompt, completion, total), or any other, with
    details that are objects (vLLM --enable-prompt-tokens-details, SGLang
    --enable-cache-report) or null."""
    p, c = draw(COUNT), draw(COUNT)
    fields: list[tuple[str, Any]] = [("prompt_tokens", p), ("total_tokens", p + c),
                                     ("completion_tokens", c)]
    order = draw(st.sampled_from(["engines", "openai", "shuffled"]))
    if order == "openai":
        fields = [fields[0], fields[2], fields[1]]
    elif order == "shuffled":
        fields = draw(st.permutations(fields))
    for name in ("prompt_tokens_details", "completion_tokens_details"):
        if draw(st.booleans()):
            fields.append((name, draw(DETAILS)))
    return dict(fields), p, c


@given(usage_objects(), st.sampled_from([None, (",", ":")]), st.booleans())
def test_usage_is_read_whatever_its_order_spacing_and_details(
        got: tuple[dict[str, Any], int, int], separators: tuple[str, str] | None,
        chunk_of_events: bool) -> None:
    usage, p, c = got
    answer = {"id": "x", "choices": [{"index": 0, "text": "usage"}], "usage": usage,
              "kv_transfer_params": None}
    body = json.dumps(answer, separators=separators).encode()
    assert read_usage(body, body.rfind(b'"usage"')) == (p, c)
    plain = UsageTap(False)
    plain.feed(body)
    plain.done()
    assert (plain.prompt, plain.completion, plain.seen) == (p, c, True)
    # A stream's usage event, with details that are objects too: read, and taken out
    # (alone in its chunk, or with the event before it in one chunk).
    ev = b"data: " + json.dumps({"choices": [], "usage": usage}, separators=separators).encode() + b"\n\n"
    wire = (TOKENS[0] + b"%x\r\n%s\r\n" % (len(ev), ev) if not chunk_of_events else
            b"%x\r\n%s\r\n" % (len(ev) + 15, b'data: {"a":1}\n\n' + ev)) + DONE
    tap = UsageTap(True, True)
    out = relay(tap, wire, [])
    assert (tap.prompt, tap.completion, tap.seen) == (p, c, True)
    assert b'"usage"' not in out and out.endswith(DONE)


@settings(max_examples=2000)
@given(st.binary(max_size=600), st.sampled_from([b"", b'"usage":', b'"usage": {"prompt_tokens": ']))
def test_any_bytes_after_usage_read_as_counts_or_nothing(junk: bytes, lead: bytes) -> None:
    # The engine's answer is peer input: whatever follows the key, a pair of counts or None,
    # never an exception (a plain answer's tail, or a stream event's payload).
    buf = lead + junk
    got = read_usage(buf, 0)
    assert got is None or all(type(n) is int and n >= 0 for n in got)
    tap = UsageTap(False)
    tap.feed(buf)
    tap.done()
    stream = UsageTap(True, True)
    stream.chunked = True
    stream.feed(b"%x\r\ndata: {%s}\n\n\r\n" % (len(buf) + 10, buf))


def test_usage_that_is_not_counts_is_not_read() -> None:
    for bad in (b'"usage":{"prompt_tokens":-1}', b'"usage":{"prompt_tokens":1.5}',
                b'"usage":{"prompt_tokens":true}', b'"usage":[1,2]', b'"usage":{"prompt_to',
                b'"usage":' + b"[" * 100_000, b'"usage":{"prompt_tokens":"3"}'):
        assert read_usage(bad, 0) is None, bad
    # vLLM's completion_tokens may be null: none completed.
    assert read_usage(b'"usage":{"prompt_tokens":4,"completion_tokens":null}', 0) == (4, 0)


def test_with_usage() -> None:
    assert with_usage({"stream": True}) == ({"stream": True, "stream_options": {"include_usage": True}}, True)
    asked = {"stream": True, "stream_options": {"include_usage": True}}
    assert with_usage(asked) == (asked, False)


def test_meter_batches_resend_until_acked() -> None:
    m = UsageMeter()
    assert m.batch("b0") is None
    m.add("k", "m", 200, 5, 2, 0.5, 7200.0)
    m.add("k", "m", 200, 1, 1, 0.5, 7300.0)
    m.add("k", "m", 429, 0, 0, 0.0, 7300.0)
    b = m.batch("b1")
    assert b is not None and b[0] == "b1"
    assert b[1] == (UsageRow("k", "m", 7200, 200, 2, 6, 3, 1.0), UsageRow("k", "m", 7200, 429, 1))
    m.add("k", "m", 200, 1, 1, 0.1, 7300.0)
    assert m.batch("b2") == b  # not acked: the same batch, same id
    m.acked("b1")
    b2 = m.batch("b3")
    assert b2 is not None and b2[0] == "b3" and b2[1][0].requests == 1
    m.acked("b3")
    assert m.unsent == 0


def test_server_counts_a_batch_once(tmp_path: Path) -> None:
    keys = ApiKeys(Store(str(tmp_path / "s.db")))
    router, admin = Peer(b"r", "router", "r1"), Peer(b"a", "admin", "ops")
    op = UsageReportOp("batch-0001", (UsageRow("k", "m", 3600, 200, 2, 6, 3, 1.0),))
    assert trio.run(keys.op_usage_report, router, op, 4000.0) == {"added": True}
    assert trio.run(keys.op_usage_report, router, op, 4001.0) == {"added": False}
    rows = trio.run(keys.op_usage, admin, UsageOp(), 4002.0)
    assert [(r["requests"], r["prompt_tokens"]) for r in rows] == [(2, 6)]
    assert keys.usage_batches == {"added": 1, "repeated": 1}
    # Prometheus on the server: counted once too.
    from llmgw.server.tenants.usage_metrics import usage_families

    samples = {(f.name, tuple(s.labels.values())): s.value
               for f in usage_families(keys.usage_totals) for s in f.samples}
    assert samples[("llmgw_server_usage_requests", ("k", "m"))] == 2
    assert samples[("llmgw_server_usage_tokens", ("k", "m", "completion"))] == 3


def test_ctl_usage_table_and_csv() -> None:
    args = build_parser().parse_args(["ctl", "usage", "--api-key", "k", "--since", "7d", "-o", "csv"])
    assert ctl_usage.op_of(args, 1_000_000.0) == UsageOp("k", "", 1_000_000.0 - 7 * 86400)
    rows = [{"hour": 3600, "api_key": "k", "model": "m", "status": 200, "requests": 2,
             "prompt_tokens": 6, "completion_tokens": 3, "latency_sum": 1.0},
            {"hour": 7200, "api_key": "k", "model": "m", "status": 429, "requests": 1,
             "prompt_tokens": 0, "completion_tokens": 0, "latency_sum": 0.0}]
    assert ctl_usage.render(args, rows).splitlines()[1] == "3600,k,m,200,2,6,3,1.0"
    args.output = "table"
    assert ctl_usage.render(args, rows).splitlines()[1].split() == ["k", "m", "3", "1", "6", "3", "333ms"]


def test_usage_body() -> None:
    from llmgw.router.tenants.usage import usage_body

    raw = b' {"model": "m", "stream": true}'
    out = usage_body(json.loads(raw), raw)
    assert out is not None and json.loads(out) == {"model": "m", "stream": True,
                                                   "stream_options": {"include_usage": True}}
    other = {"model": "m", "stream": True, "stream_options": {"include_usage": False}}
    out = usage_body(other, json.dumps(other).encode())
    assert out is not None and json.loads(out)["stream_options"] == {"include_usage": True}
    asked = {"model": "m", "stream": True, "stream_options": {"include_usage": True}}
    assert usage_body(asked, json.dumps(asked).encode()) is None


def test_usage_event_sharing_a_chunk_with_others() -> None:
    a = b'data: {"choices": [{"text": "z"}]}\n\n'
    u = b'data: {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}}\n\n'
    d = b"data: [DONE]\n\n"
    both = a + u + d
    wire = b"%x\r\n%s\r\n" % (len(both), both)
    tap = UsageTap(stream=True, strip=True)
    out = relay(tap, wire, [])
    assert (tap.prompt, tap.completion) == (2, 1)
    kept = a + d
    assert out == b"%x\r\n%s\r\n" % (len(kept), kept)  # the token and [DONE] stay, re-framed

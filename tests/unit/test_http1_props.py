"""Properties of the HTTP/1.1 core (llmgw.http1): total (whatever bytes, a result or H1Error) and
incremental (the same bytes split anywhere give the same result as fed at once)."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llmgw.http1 import grammar, response
from llmgw.http1.chunked import ChunkedReader, dechunk
from llmgw.http1.grammar import H1Error
from llmgw.http1.request import RequestParser
from llmgw.http1.response import parse_response_head
from llmgw.router.connection.jsondepth import too_deep

LIMIT = 4096
# Thousands of examples for the client side (what anyone can send), fewer for the engine side.
MANY = settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SOME = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])

BODY = b'{"model":"m","prompt":"hi"}'
VALID_REQUESTS = [
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY),
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    b'5;e=1\r\n{"mod\r\n16\r\nel":"m","prompt":"hi"}\r\n0\r\nx-t: 1\r\n\r\n',
    b"GET /v1/models HTTP/1.0\r\nconnection: keep-alive\r\n\r\n",
    b"\r\nGET /health HTTP/1.1\r\nexpect: 100-continue\r\n\r\n",
    b"POST / HTTP/1.1\r\ncontent-length: 3\r\n\r\nabcGET / HTTP/1.1\r\n\r\n",
]
VALID_RESPONSES = [
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked",
    b"HTTP/1.1 404 Not Found\r\ncontent-length: 12\r\nconnection: close",
    b"HTTP/1.0 200 OK",
]
VALID_CHUNKED = [
    b"5\r\nhello\r\n6;x=y\r\n world\r\n0\r\n\r\n",
    b"1a\r\n" + b"z" * 26 + b"\r\n0\r\nt: v\r\n\r\n",
]
# Bytes that matter to the grammar, so mutations hit the interesting cases often.
SPECIAL = st.sampled_from(
    [
        b"\r\n",
        b"\r",
        b"\n",
        b":",
        b" ",
        b";",
        b"0",
        b"9",
        b"a",
        b"x",
        b"+",
        b"_",
        b"\x00",
        b"\xff",
        b"\r\n\r\n",
    ]
)


@st.composite
def mutated(draw: st.DrawFn, seeds: list[bytes]) -> bytes:
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.integers(0, 3))
        pos = draw(st.integers(0, len(data)))
        if op == 0 and data:  # delete a span
            end = draw(st.integers(pos, min(len(data), pos + 8)))
            del data[pos:end]
        elif op == 1:  # insert a grammar byte string
            data[pos:pos] = draw(SPECIAL)
        elif op == 2:  # insert random bytes
            data[pos:pos] = draw(st.binary(max_size=8))
        elif data:  # flip a byte
            p = min(pos, len(data) - 1)
            data[p] = draw(st.integers(0, 255))
    return bytes(data)


def run_parser(chunks: list[bytes]) -> list[object]:
    """Feed the pieces one by one, taking every request; the outcome as plain data."""
    p = RequestParser(LIMIT)
    out: list[object] = []
    for c in chunks:
        p.feed(c)
        while True:
            try:
                req = p.next()
            except H1Error as exc:
                assert 400 <= exc.status < 500
                out.append(("error", exc.status))  # any 4xx: checked above
                return out
            if req is None:
                break
            out.append((req.method, req.target, sorted(req.headers.items()), req.body, req.keep_alive))
    out.append(("pending", p.in_head))
    return out


def splits(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    pieces, last = [], 0
    for c in points:
        pieces.append(data[last:c])
        last = c
    pieces.append(data[last:])
    return pieces


requests = st.one_of(st.binary(max_size=300), mutated(VALID_REQUESTS), st.sampled_from(VALID_REQUESTS))


@MANY
@given(requests, st.lists(st.integers(0, 400), max_size=6))
def test_request_parser_total_and_incremental(data: bytes, cuts: list[int]) -> None:
    whole = run_parser([data])
    assert run_parser(splits(data, cuts)) == whole
    if len(data) <= 160:
        assert run_parser([data[i : i + 1] for i in range(len(data))]) == whole


def test_valid_requests_parse() -> None:
    for data in VALID_REQUESTS:
        out = run_parser([data])
        assert out[-1] == ("pending", False) and not any(
            isinstance(o, tuple) and o[0] == "error" for o in out
        ), out


@SOME
@given(st.one_of(st.binary(max_size=300), mutated(VALID_RESPONSES)))
def test_response_head_total(raw: bytes) -> None:
    try:
        h = parse_response_head(raw)
    except H1Error as exc:
        assert exc.status == 502
        return
    assert 100 <= h.status <= 999 and h.framing in ("chunked", "length", "close")
    assert b"\r" not in h.content_type and b"\n" not in h.content_type


def scan(pieces: list[bytes]) -> tuple[object, ...]:
    s = ChunkedReader()
    out = b""
    try:
        for piece in pieces:
            fwd, done = s.feed(piece)
            out += fwd
            if done:
                return ("done", out, s.extra)
    except H1Error as exc:
        assert exc.status == 502
        return ("error",)
    return ("more", out + s.partial)


chunked = st.one_of(st.binary(max_size=200), mutated(VALID_CHUNKED), st.sampled_from(VALID_CHUNKED))


@SOME
@given(chunked, st.lists(st.integers(0, 200), max_size=6))
@example(b"1a\r\n" + b"\x00" * 26 + b"\r\n0\r\n\x00\x00\x00\x00\r\n\r\n\x00", [43])  # a byte past the end
def test_chunk_scanner_total_and_incremental(wire: bytes, cuts: list[int]) -> None:
    whole = scan([wire])
    split = scan(splits(wire, cuts))
    if whole[0] == "error":
        # Split, the error may show only once a later piece arrives, never sooner.
        assert split[0] in ("error", "more")
    elif whole[0] == "done":
        # Bytes after the body's end show as `extra` only if they came in the piece that
        # ended it: the split scan stops there, so it may not have seen them.
        assert split[:2] == whole[:2] and (whole[2] or not split[2])
    else:
        assert split == whole
    if whole[0] == "done":
        # What went out is well framed: dechunk reads it (with the end the relay writes).
        fwd = whole[1]
        assert isinstance(fwd, bytes)
        dechunk(fwd + b"0\r\n\r\n")


@SOME
@given(chunked)
def test_dechunk_total(wire: bytes) -> None:
    try:
        dechunk(wire)
    except H1Error as exc:
        assert exc.status == 502


@settings(max_examples=1000, deadline=None)
@given(
    st.recursive(
        st.none() | st.integers() | st.text(max_size=5),
        lambda k: st.lists(k, max_size=3) | st.dictionaries(st.text(max_size=3), k, max_size=3),
        max_leaves=200,
    )
)
def test_json_depth_matches_a_reference(value: object) -> None:
    import json

    def depth(o: object) -> int:
        if isinstance(o, list):
            return 1 + max((depth(x) for x in o), default=0)
        if isinstance(o, dict):
            return 1 + max((depth(x) for x in o.values()), default=0)
        return 0

    body = json.dumps(value).encode()
    for limit in (0, 1, 2, 3, 5, 128):
        assert too_deep(body, limit) == (depth(value) > limit), (body, limit)


@SOME
@given(st.one_of(st.binary(max_size=300), st.text(alphabet='[]{}"\\,1 a', max_size=300).map(str.encode)))
def test_json_depth_total(body: bytes) -> None:
    assert too_deep(body) in (True, False)


# The one-pass grammar check (grammar.REQUEST_HEAD, _RESPONSE_HEAD) lets a head skip the
# line-by-line checks; it may do so only for heads those checks accept. Heads near the
# grammar (mutated valid ones) are where the two could part.
def _slow_checks_pass(head: bytes, first_line_ok: bool) -> bool:
    lines = head.split(b"\r\n")
    return (first_line_ok and head.count(b"\r\n") <= grammar.MAX_FIELDS and not grammar.bad_controls(head)
            and all(sep and grammar.TOKEN.fullmatch(name)
                    for name, sep, _ in (line.partition(b":") for line in lines[1:])))


def _request_line_ok(line: bytes) -> bool:
    parts = line.split(b" ")
    return len(parts) == 3 and bool(grammar.TOKEN.fullmatch(parts[0])) and bool(parts[1])


@MANY
@given(mutated([r.split(b"\r\n\r\n", 1)[0].lstrip(b"\r\n") for r in VALID_REQUESTS]))
def test_request_fast_path_only_for_heads_the_slow_checks_accept(head: bytes) -> None:
    if grammar.REQUEST_HEAD.fullmatch(head):
        assert _slow_checks_pass(head, _request_line_ok(head.split(b"\r\n", 1)[0]))


@MANY
@given(mutated(VALID_RESPONSES))
def test_response_fast_path_only_for_heads_the_slow_checks_accept(head: bytes) -> None:
    if grammar.RESPONSE_HEAD.fullmatch(head):
        assert _slow_checks_pass(head, bool(grammar.STATUS.fullmatch(head.split(b"\r\n", 1)[0])))


def test_response_head_cache_is_bounded_and_returns_the_same_answer() -> None:
    raw = b"HTTP/1.1 200 OK\r\ncontent-length: 2"
    assert parse_response_head(raw) is parse_response_head(raw)
    for i in range(3 * response.HEAD_CACHE_SIZE):
        assert parse_response_head(b"HTTP/1.1 200 OK\r\ncontent-length: %d" % i).length == i
    assert len(response._HEAD_CACHE) <= response.HEAD_CACHE_SIZE
    big = b"HTTP/1.1 200 OK\r\nx: " + b"v" * response.HEAD_CACHE_BYTES
    parse_response_head(big)
    assert big not in response._HEAD_CACHE

"""The sans-IO HTTP/1.1 core (llmgw.http1) and the router's JSON depth scan, rule by rule."""

from __future__ import annotations

import json

import pytest

from llmgw.http1.chunked import ChunkedReader, dechunk
from llmgw.http1.grammar import MAX_FIELDS, MAX_HEAD, H1Error
from llmgw.http1.request import Request, RequestParser
from llmgw.http1.response import parse_response_head
from llmgw.router.connection.jsondepth import MAX_DEPTH, too_deep

LIMIT = 8 * 1024 * 1024
BODY = b'{"model": "m"}'


def parse(data: bytes, limit: int = LIMIT) -> Request | None:
    p = RequestParser(limit)
    p.feed(data)
    return p.next()


def status_of(data: bytes, limit: int = LIMIT) -> int:
    with pytest.raises(H1Error) as e:
        parse(data, limit)
    return e.value.status


def post(headers: bytes, body: bytes = b"") -> bytes:
    return b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n" + headers + b"\r\n" + body


# ---- request parser: good requests ---------------------------------------------------------


def test_content_length_request() -> None:
    req = parse(post(b"content-length: %d\r\n" % len(BODY), BODY))
    assert req is not None
    assert (req.method, req.target, req.body) == (b"POST", b"/v1/completions", BODY)
    assert req.header(b"host") == b"x" and req.keep_alive and not req.http10


def test_need_more_then_request() -> None:
    p = RequestParser(LIMIT)
    data = post(b"content-length: %d\r\n" % len(BODY), BODY)
    p.feed(data[:10])
    assert p.next() is None and p.in_head
    p.feed(data[10:-3])
    assert p.next() is None and not p.in_head
    p.feed(data[-3:])
    req = p.next()
    assert req is not None and req.body == BODY


def test_pipelined_requests_and_leading_empty_lines() -> None:
    one = post(b"content-length: %d\r\n" % len(BODY), BODY)
    p = RequestParser(LIMIT)
    p.feed(b"\r\n" + one + one)
    a, b = p.next(), p.next()
    assert a is not None and b is not None and a.body == b.body == BODY
    assert p.next() is None and not p.in_head


def test_chunked_request_with_ext_and_trailers() -> None:
    body = b"5;name=val\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: 1\r\n\r\n"
    req = parse(post(b"transfer-encoding: chunked\r\n", body))
    assert req is not None and req.body == b"hello world"


def test_chunk_size_upper_and_lower_hex() -> None:
    req = parse(post(b"transfer-encoding: chunked\r\n", b"A\r\n0123456789\r\na\r\n0123456789\r\n0\r\n\r\n"))
    assert req is not None and len(req.body) == 20


def test_connection_tokens_and_http10() -> None:
    req = parse(b"GET /health HTTP/1.0\r\n\r\n")
    assert req is not None and req.http10 and not req.keep_alive
    req = parse(b"GET /health HTTP/1.0\r\nconnection: keep-alive\r\n\r\n")
    assert req is not None and req.keep_alive
    req = parse(b"GET /health HTTP/1.1\r\nconnection: foo, close\r\n\r\n")
    assert req is not None and not req.keep_alive


def test_expect_continue_is_flagged_once_the_head_is_in() -> None:
    p = RequestParser(LIMIT)
    p.feed(post(b"expect: 100-continue\r\ncontent-length: %d\r\n" % len(BODY)))
    assert p.next() is None and p.continue_wanted
    p.feed(BODY)
    req = p.next()
    assert req is not None and req.body == BODY and not p.continue_wanted


def test_content_length_leading_zeros_and_exact_limit() -> None:
    req = parse(post(b"content-length: 0000000000000000000000000014\r\n", BODY))
    assert req is not None and req.body == BODY
    req = parse(post(b"content-length: 14\r\n", BODY), limit=14)
    assert req is not None


# ---- request parser: each rule and its status ---------------------------------------------


@pytest.mark.parametrize(
    ("data", "status"),
    [
        # Content-Length: digits only, bounded before int() (issue 9: 5,000 digits crashed).
        (post(b"content-length: " + b"9" * 5000 + b"\r\n"), 413),
        (post(b"content-length: 1" + b"0" * 30 + b"\r\n"), 413),
        (post(b"content-length: 8388609\r\n"), 413),
        (post(b"content-length: +5\r\n"), 400),
        (post(b"content-length: -1\r\n"), 400),
        (post(b"content-length: 0x10\r\n"), 400),
        (post(b"content-length: 1_0\r\n"), 400),
        (post(b"content-length: 5, 5\r\n"), 400),
        (post(b"content-length: \r\n"), 400),
        (post(b"content-length: \xd9\xa3\r\n"), 400),  # Arabic-Indic three
        (post(b"content-length: 1\r\ncontent-length: 2\r\n"), 400),
        # Content-Length with Transfer-Encoding: smuggling.
        (post(b"content-length: 3\r\ntransfer-encoding: chunked\r\n"), 400),
        (post(b"transfer-encoding: chunked\r\ncontent-length: 3\r\n"), 400),
        (post(b"transfer-encoding: gzip, chunked\r\n"), 400),
        (post(b"transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n"), 400),
        # Request line, names, controls.
        (b"POST /v1/completions HTTP/1.1 extra\r\n\r\n", 400),
        (b"POST  /v1/completions HTTP/1.1\r\n\r\n", 400),
        (b"P(ST / HTTP/1.1\r\n\r\n", 400),
        (b"POST / HTTP/2.0\r\n\r\n", 400),
        (b"POST / http/1.1\r\n\r\n", 400),
        (post(b"host : x\r\n"), 400),
        (post(b" folded\r\n"), 400),
        (post(b"no-colon\r\n"), 400),
        (post(b"x: a\x00b\r\n"), 400),
        (post(b"x: a\rb\r\n"), 400),
        (post(b"x: a\nb\r\n"), 400),
    ],
)
def test_request_rules(data: bytes, status: int) -> None:
    assert status_of(data) == status


@pytest.mark.parametrize(
    "chunks",
    [
        b"0x2\r\nab\r\n0\r\n\r\n",
        b"0_2\r\nab\r\n0\r\n\r\n",
        b"+2\r\nab\r\n0\r\n\r\n",
        b"-0\r\n\r\n",
        b" 2\r\nab\r\n0\r\n\r\n",
        b"2 \r\nab\r\n0\r\n\r\n",
        b"\r\nab\r\n0\r\n\r\n",
        b"g\r\n0\r\n\r\n",
        b"2\r\nabc\r\n0\r\n\r\n",  # data longer than its size
        b"2\r\nab0\r\n\r\n",  # no CRLF after the data
        b"1" * 17 + b"\r\n",  # more than 16 hex digits
        b"2;ext\x00\r\nab\r\n0\r\n\r\n",  # control character in chunk-ext
        b"2\nab\r\n0\r\n\r\n",  # bare LF
        b"0\r\nbad trailer\r\n\r\n",
    ],
)
def test_chunk_rules(chunks: bytes) -> None:
    assert status_of(post(b"transfer-encoding: chunked\r\n", chunks)) == 400


def test_chunk_size_line_too_long_even_unfinished() -> None:
    assert status_of(post(b"transfer-encoding: chunked\r\n", b"1;" + b"e" * 2000)) == 400


def test_chunked_over_the_body_limit_is_413() -> None:
    assert status_of(post(b"transfer-encoding: chunked\r\n", b"11\r\n"), limit=16) == 413
    body = b"8\r\n12345678\r\n" * 3
    assert status_of(post(b"transfer-encoding: chunked\r\n", body), limit=20) == 413


def test_chunked_framing_far_over_the_payload_is_413() -> None:
    one = b"1;" + b"e" * 1000 + b"\r\nx\r\n"
    assert status_of(post(b"transfer-encoding: chunked\r\n", one * 200), limit=1000) == 413


def test_head_over_64k_is_431_in_one_read_or_many() -> None:
    big = post(b"x: " + b"a" * (MAX_HEAD + 10) + b"\r\n")
    assert status_of(big) == 431  # all in one read: issue 9 got 200
    p = RequestParser(LIMIT)
    with pytest.raises(H1Error) as e:
        for i in range(0, len(big), 1000):
            p.feed(big[i : i + 1000])
            p.next()
    assert e.value.status == 431
    # Without an end of head at all, the buffered bytes are measured too.
    assert status_of(b"GET / HTTP/1.1\r\nx: " + b"a" * (MAX_HEAD + 10)) == 431


def test_too_many_fields_is_431_and_the_limit_itself_passes() -> None:
    ok = b"".join(b"x%d: v\r\n" % i for i in range(MAX_FIELDS))
    assert parse(post(ok[: -len(b"x99: v\r\n")])) is not None  # host + 99 = 100 fields
    assert status_of(post(ok)) == 431  # host + 100
    many = b"".join(b"x: v\r\n" for _ in range(10_000))
    assert status_of(post(many)) == 431


def test_trailers_bounded() -> None:
    many = b"0\r\n" + b"t: v\r\n" * (MAX_FIELDS + 1) + b"\r\n"
    assert status_of(post(b"transfer-encoding: chunked\r\n", many)) == 431
    huge = b"0\r\nt: " + b"v" * (MAX_HEAD + 10)
    assert status_of(post(b"transfer-encoding: chunked\r\n", huge)) == 431


def test_error_is_sticky() -> None:
    p = RequestParser(LIMIT)
    p.feed(b"BAD\r\n\r\n")
    for _ in range(2):
        with pytest.raises(H1Error):
            p.next()


def test_slow_head_costs_linear_work() -> None:
    # One byte at a time: the end of the head is searched for only in the new bytes.
    p = RequestParser(LIMIT)
    data = post(b"x: " + b"a" * 20000 + b"\r\n")
    for i in range(len(data) - 1):
        p.feed(data[i : i + 1])
        assert p.next() is None
    p.feed(data[-1:])
    assert p.next() is not None


# ---- response side -------------------------------------------------------------------------


def test_response_head_framings() -> None:
    h = parse_response_head(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
    )
    assert (h.status, h.framing, h.keep_alive, h.content_type) == (200, "chunked", True, b"text/event-stream")
    h = parse_response_head(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0012")
    assert (h.framing, h.length) == ("length", 12)
    h = parse_response_head(b"HTTP/1.0 200 OK\r\ncontent-length: 2")
    assert not h.keep_alive
    h = parse_response_head(b"HTTP/1.1 200")
    assert (h.framing, h.keep_alive) == ("close", False)
    h = parse_response_head(b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip")
    assert h.framing == "close"


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 2000 OK",
        b"HTTP/1.1 20 OK",
        b"HTTP/2 200 OK",
        b"HTTP/1.1 +20 OK",
        b"garbage",
        b"HTTP/1.1 200 OK\r\ncontent-length: " + b"9" * 5000,
        b"HTTP/1.1 200 OK\r\ncontent-length: 0x10",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ntransfer-encoding: chunked",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, gzip",
        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\nx-injected: 1",
        b"HTTP/1.1 200 OK\r\nbad line",
        b"HTTP/1.1 200 OK" + b"\r\nx: v" * (MAX_FIELDS + 1),
    ],
)
def test_response_head_rules(raw: bytes) -> None:
    with pytest.raises(H1Error) as e:
        parse_response_head(raw)
    assert e.value.status == 502


def test_chunk_scanner_forwards_bytes_as_they_are() -> None:
    wire = b"5\r\nhello\r\n6;x=y\r\n world\r\n0\r\n\r\n"
    for split in range(1, len(wire)):
        s = ChunkedReader()
        out1, done1 = s.feed(wire[:split])
        out2, done2 = (b"", True) if done1 else s.feed(wire[split:])
        assert out1 + out2 == wire[: -len(b"0\r\n\r\n")] and done2 and not s.extra


@pytest.mark.parametrize(
    "wire",
    [
        b"0x5\r\nhello\r\n",
        b"+5\r\nhello\r\n",
        b"5\r\nhelloXY",
        b"1" * 17 + b"\r\n",
        b"5\r\nhello\r\n" + b"z" * 2000,
    ],
)
def test_chunk_scanner_rules(wire: bytes) -> None:
    with pytest.raises(H1Error):
        ChunkedReader().feed(wire)


def test_chunk_scanner_notes_bytes_after_the_end() -> None:
    s = ChunkedReader()
    assert s.feed(b"0\r\n\r\nHTTP/1.1 200 OK\r\n")[1] and s.extra


def test_dechunk() -> None:
    assert dechunk(b"5\r\nhello\r\n1;e\r\n!\r\n0\r\n\r\n") == b"hello!"
    for bad in (b"0x5\r\nhello\r\n0\r\n\r\n", b"5\r\nhel", b"5\r\nhelloXX0\r\n\r\n", b"", b"zz\r\n"):
        with pytest.raises(H1Error):
            dechunk(bad)


# ---- JSON depth ------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1, 100_000])
def test_json_depth_exact_at_the_limit(depth: int) -> None:
    arrays = b"[" * depth + b"]" * depth
    assert too_deep(arrays) == (depth > MAX_DEPTH)
    n = 2 * ((depth + 1) // 2)  # objects and arrays alternating, n levels
    obj = b'{"a":[' * (n // 2) + b"1" + b"]}" * (n // 2)
    assert too_deep(obj) == (n > MAX_DEPTH)


def test_json_depth_ignores_brackets_in_strings() -> None:
    body = json.dumps({"model": "m", "prompt": "[{" * 10_000 + '\\"[[' * 300}).encode()
    assert not too_deep(body)
    escaped = b'{"a":"\\\\","b":' + b"[" * 200 + b"]" * 200 + b"}"  # "\\" ends the string
    assert json.loads(escaped) and too_deep(escaped)
    quote = b'{"a":"\\"[[[[","b":' + b"[" * 100 + b"]" * 100 + b"}"
    assert json.loads(quote) and not too_deep(quote)


def test_json_depth_many_shallow_brackets_allowed() -> None:
    body = json.dumps({"model": "m", "prompt": [[i, i] for i in range(50_000)]}).encode()
    assert not too_deep(body)
    wide = b"[" + b",".join([b"[" * 128 + b"]" * 128] * 200) + b"]"
    assert too_deep(wide)  # 129 with the outer array
    assert not too_deep(wide[1:-1].split(b",")[0])

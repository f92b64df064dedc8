"""ResponseParser (an engine's answers: head framing, 1xx, whole bodies), ChunkedReader's
gathering mode, and the one-off GET client on a loopback socket."""

from __future__ import annotations

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.http1.chunked import ChunkedReader
from llmgw.http1.client import NoAnswer, get, request
from llmgw.http1.grammar import MAX_HEAD, H1Error
from llmgw.http1.response import ResponseParser

LENGTH = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 5\r\n\r\nhello"
CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nhel\r\n2;x=1\r\nlo\r\n0\r\nt: 1\r\n\r\n"
CLOSE = b"HTTP/1.0 200 OK\r\n\r\nhello"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n" + LENGTH


def whole(pieces: list[bytes], eof: bool = True) -> tuple[object, ...]:
    """Feed the pieces, then EOF: (status, body, clean), or ("error", status), or None."""
    p = ResponseParser()
    try:
        head = None
        body = None
        for i, piece in enumerate(pieces):
            p.feed(piece)
            if eof and i == len(pieces) - 1:
                p.eof()
            if head is None:
                head = p.head()
            if head is not None and body is None:
                body = p.body()
        if head is None or body is None:
            return ("more",)
        return (head.status, body, p.clean)
    except H1Error as exc:
        return ("error", exc.status)


def test_bodies_by_length_chunked_and_close() -> None:
    assert whole([LENGTH], eof=False) == (200, b"hello", True)
    assert whole([CHUNKED], eof=False) == (200, b"hello", True)
    assert whole([CLOSE], eof=False) == ("more",)  # its end is the connection's
    assert whole([CLOSE]) == (200, b"hello", False)
    assert whole([CONTINUE], eof=False) == (200, b"hello", True)  # 1xx skipped


def test_not_clean_when_more_follows_or_the_engine_closes() -> None:
    assert whole([LENGTH + b"extra"], eof=False) == (200, b"hello", False)
    assert whole([CHUNKED + b"x"], eof=False) == (200, b"hello", False)
    closing = LENGTH.replace(b"content-length: 5", b"connection: close\r\ncontent-length: 5")
    assert whole([closing], eof=False) == (200, b"hello", False)


def test_errors() -> None:
    assert whole([b""]) == ("error", 502)  # closed without answering
    assert whole([LENGTH[:-2]]) == ("error", 502)  # closed mid-body
    assert whole([CHUNKED[:-9]]) == ("error", 502)
    assert whole([b"HTTP/1.1 200 OK\r\nx: " + b"a" * (MAX_HEAD + 10)], eof=False) == ("error", 502)
    assert whole([b"HTTP/1.1 2000 OK\r\n\r\n"]) == ("error", 502)


def test_take_hands_over_what_came_after_the_head() -> None:
    p = ResponseParser()
    p.feed(CHUNKED[:60])
    head = p.head()
    assert head is not None and head.framing == "chunked"
    assert p.take() == CHUNKED[CHUNKED.index(b"\r\n\r\n") + 4 : 60]
    assert p.take() == b""


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([LENGTH, CHUNKED, CLOSE, CONTINUE]), st.lists(st.integers(0, 120), max_size=5),
       st.booleans())
def test_the_same_answer_however_the_bytes_arrive(wire: bytes, cuts: list[int], eof: bool) -> None:
    points = sorted({min(c, len(wire)) for c in cuts})
    pieces = [wire[a:b] for a, b in zip([0, *points], [*points, len(wire)], strict=True)]
    assert whole(pieces, eof) == whole([wire], eof)


def test_chunked_reader_gathers_the_payload_and_keeps_what_follows() -> None:
    r = ChunkedReader(400, keep=True, limit=10, big=431, strict=True)
    fwd, done = r.feed(b"3\r\nabc\r\n0\r\n\r\nGET /")
    assert done and fwd == b"3\r\nabc\r\n" and r.body == b"abc" and r.rest == b"GET /"
    with pytest.raises(H1Error) as over:
        ChunkedReader(400, keep=True, limit=2).feed(b"3\r\nabc\r\n")
    assert over.value.status == 413
    with pytest.raises(H1Error) as bad:
        ChunkedReader(400, keep=True, strict=True).feed(b"0\r\nbad trailer\r\n\r\n")
    assert bad.value.status == 400


async def _serve_once(answer: bytes, listeners: list[trio.SocketListener]) -> None:
    stream = await listeners[0].accept()
    async with stream:
        await stream.receive_some(4096)
        await stream.send_all(answer)


@pytest.mark.parametrize(
    ("answer", "head_only", "want"),
    [
        (LENGTH, False, (200, b"hello")),
        (CHUNKED, False, (200, b"hello")),
        (CLOSE, False, (200, b"hello")),
        (b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n", True, (503, b"")),
        (b"not http\r\n\r\n", False, (0, b"")),
        (LENGTH[:-2], False, (0, b"")),  # the server closed mid-body
    ],
)
async def test_get(answer: bytes, head_only: bool, want: tuple[int, bytes]) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_serve_once, answer, listeners)
        assert await get("127.0.0.1", port, "/x", timeout=5, head_only=head_only) == want
    for lst in listeners:
        await lst.aclose()


async def test_get_gives_up_on_a_silent_server(autojump_clock: trio.testing.MockClock) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    assert await get("127.0.0.1", port, "/x", timeout=2) == (0, b"")  # accepted, never answered
    for lst in listeners:
        await lst.aclose()


async def test_request_sends_its_body_and_names_what_went_wrong() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    got: list[bytes] = []

    async def echo() -> None:
        stream = await listeners[0].accept()
        async with stream:
            data = b""
            while not data.endswith(b"{}"):
                data += await stream.receive_some(4096)
            got.append(data)
            await stream.send_all(LENGTH)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(echo)
        assert await request("127.0.0.1", port, "POST", "/x", b"{}", timeout=5,
                             headers=(("Content-Type", "application/json"),)) == (200, b"hello")
    assert got[0].startswith(b"POST /x HTTP/1.1\r\n")
    assert b"\r\nContent-Length: 2\r\n" in got[0] and b"\r\nContent-Type: application/json\r\n" in got[0]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_serve_once, LENGTH, listeners)
        with pytest.raises(NoAnswer, match="larger than 10 bytes"):
            await request("127.0.0.1", port, "GET", "/x", timeout=5, max_answer=10)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_serve_once, b"SSH-2.0-OpenSSH\r\n\r\n", listeners)
        with pytest.raises(NoAnswer, match="not an HTTP/1.1 answer"):
            await request("127.0.0.1", port, "GET", "/x", timeout=5)
    for lst in listeners:
        await lst.aclose()

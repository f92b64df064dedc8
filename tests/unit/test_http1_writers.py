"""The body writers (llmgw.http1.writers): what each writes reads back, through llmgw's own
readers (ChunkedReader, ResponseParser), to the same bytes, however it is split; the
length writer refuses too many bytes and too few; nothing is written after the end."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.http1.chunked import ChunkedReader, dechunk
from llmgw.http1.response import ResponseParser
from llmgw.http1.writers import (
    LAST_CHUNK,
    BodyWriter,
    ChunkedWriter,
    CloseWriter,
    FramingError,
    LengthWriter,
    chunk,
    writer_for,
)

PIECES = st.lists(st.binary(max_size=300), max_size=12)
SOME = settings(max_examples=400, deadline=None)


def written(writer: BodyWriter, pieces: list[bytes]) -> bytes:
    return b"".join(writer.data(p) for p in pieces) + writer.end()


def test_chunked_frames_each_piece_and_ends_with_the_zero_chunk() -> None:
    w = ChunkedWriter()
    assert w.data(b"hello") == b"5\r\nhello\r\n"
    assert w.data(b"x" * 26) == b"1a\r\n" + b"x" * 26 + b"\r\n"
    assert w.end() == b"0\r\n\r\n" == LAST_CHUNK


def test_chunked_writes_nothing_for_empty_data() -> None:
    # An empty chunk would be the zero-size chunk: the end of the body.
    w = ChunkedWriter()
    assert w.data(b"") == b""
    assert chunk(b"") == b""
    assert dechunk(w.data(b"a") + w.data(b"") + w.data(b"b") + w.end()) == b"ab"


def test_chunk_alone_is_one_chunk() -> None:
    assert chunk(b"data: {}\n\n") == b"a\r\ndata: {}\n\n\r\n"


def test_length_refuses_too_many_bytes_at_once() -> None:
    w = LengthWriter(4)
    assert w.data(b"ab") == b"ab"
    with pytest.raises(FramingError, match="3 bytes where 2 were left"):
        w.data(b"cde")
    assert w.data(b"cd") == b"cd"
    assert w.end() == b""


def test_length_refuses_too_few_bytes_at_the_end() -> None:
    w = LengthWriter(4)
    w.data(b"abc")
    with pytest.raises(FramingError, match="1 bytes short"):
        w.end()


def test_length_refuses_a_negative_length() -> None:
    with pytest.raises(FramingError):
        LengthWriter(-1)


def test_close_writes_the_data_as_it_is_and_nothing_at_the_end() -> None:
    w = CloseWriter()
    assert w.data(b"abc") == b"abc"
    assert w.end() == b""


@pytest.mark.parametrize("make", [ChunkedWriter, lambda: LengthWriter(0), CloseWriter])
def test_nothing_after_the_end(make: type[ChunkedWriter]) -> None:
    w = make()
    w.end()
    with pytest.raises(FramingError):
        w.data(b"x")
    with pytest.raises(FramingError):
        w.end()


def test_writer_for_names_the_framings_as_the_response_head_does() -> None:
    assert isinstance(writer_for("chunked"), ChunkedWriter)
    length = writer_for("length", 3)
    assert isinstance(length, LengthWriter) and length.left == 3
    assert isinstance(writer_for("close"), CloseWriter)
    with pytest.raises(FramingError):
        writer_for("gzip")


def splits(data: bytes, cuts: list[int]) -> list[bytes]:
    at = sorted({c % (len(data) + 1) for c in cuts})
    # No empty part: a read that gives nothing is the connection's end, never fed.
    return [data[a:b] for a, b in zip([0, *at], [*at, len(data)], strict=True) if b > a]


@SOME
@given(PIECES, st.lists(st.integers(min_value=0), max_size=8))
def test_chunked_output_reads_back_through_the_chunked_reader(pieces: list[bytes], cuts: list[int]) -> None:
    wire = written(ChunkedWriter(), pieces)
    reader = ChunkedReader(502, keep=True)
    forwarded = b""
    done = False
    for part in splits(wire, cuts):
        fwd, done = reader.feed(part)
        forwarded += fwd
    assert done and not reader.extra
    assert reader.body is not None and bytes(reader.body) == b"".join(pieces)
    # What a relay forwards is the chunks as written, less the end it writes itself.
    assert forwarded + LAST_CHUNK == wire


@SOME
@given(PIECES, st.sampled_from(["chunked", "length", "close"]), st.lists(st.integers(min_value=0), max_size=8))
def test_each_framing_reads_back_through_the_response_parser(
        pieces: list[bytes], framing: str, cuts: list[int]) -> None:
    body = b"".join(pieces)
    header = {"chunked": b"transfer-encoding: chunked\r\n",
              "length": b"content-length: %d\r\n" % len(body),
              "close": b"connection: close\r\n"}[framing]
    wire = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n%s\r\n" % header
    wire += written(writer_for(framing, len(body)), pieces)
    p = ResponseParser()
    got: bytes | None = None
    head = None
    for part in splits(wire, cuts):
        p.feed(part)
        if head is None:
            head = p.head()
        if head is not None and got is None:
            got = p.body()
    if got is None:
        p.eof()  # a close-delimited body ends with the connection
        if head is None:
            head = p.head()
        got = p.body()
    assert head is not None and head.framing == framing
    assert got == body
    assert p.clean == (framing != "close")


@SOME
@given(PIECES, st.integers(min_value=0, max_value=2000))
def test_length_writes_exactly_its_length_or_refuses(pieces: list[bytes], length: int) -> None:
    w = LengthWriter(length)
    out = b""
    try:
        for p in pieces:
            out += w.data(p)
        out += w.end()
    except FramingError:
        assert len(b"".join(pieces)) != length
        assert len(out) <= length
    else:
        assert out == b"".join(pieces) and len(out) == length

"""SSE framing and the client-side parser, across arbitrary chunk boundaries."""

from __future__ import annotations

from itertools import pairwise

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from triode.edge.sse import DONE, KEEPALIVE, SSE_HEADERS, SSEParser, event, parse

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


def test_event_frames_one_data_line() -> None:
    assert event(b'{"a":1}') == b'data: {"a":1}\n\n'


@pytest.mark.parametrize("payload", [b"a\nb", b"a\rb", b"\n"])
def test_event_refuses_line_breaks(payload: bytes) -> None:
    with pytest.raises(ValueError, match="line breaks"):
        event(payload)


def test_a_named_event_has_its_event_line_first() -> None:
    frame = event(b'{"a":1}', name="response.created")
    assert frame == b'event: response.created\ndata: {"a":1}\n\n'
    assert SSEParser().feed(frame) == [b'{"a":1}']  # the name is a field the parser skips
    with pytest.raises(ValueError):
        event(b"{}", name="a\nb")


def test_done_and_keepalive_frames() -> None:
    assert DONE == b"data: [DONE]\n\n"
    assert KEEPALIVE == b": keep-alive\n\n"
    assert parse(KEEPALIVE + DONE) == [b"[DONE]"]


def test_headers_declare_an_uncached_event_stream() -> None:
    headers = dict(SSE_HEADERS)
    assert headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert headers[b"cache-control"] == b"no-cache"
    assert headers[b"x-accel-buffering"] == b"no"


def test_parse_joins_multiline_data_and_skips_comments_and_other_fields() -> None:
    stream = b": hello\nevent: delta\nid: 7\ndata: one\ndata:two\ndata:  three\n\n"
    assert parse(stream) == [b"one\ntwo\n three"]


def test_parse_accepts_crlf_line_endings() -> None:
    assert parse(b"data: a\r\n\r\ndata: b\r\ndata: c\r\n\r\n") == [b"a", b"b\nc"]


def test_parse_drops_an_unterminated_trailing_event() -> None:
    assert parse(b"data: a\n\ndata: b\n") == [b"a"]


def test_blank_lines_without_data_dispatch_nothing() -> None:
    assert parse(b"\n\n: ping\n\n\n") == []


def test_empty_data_field_is_an_empty_event() -> None:
    assert parse(b"data:\n\n") == [b""]


def test_parser_keeps_state_between_feeds() -> None:
    parser = SSEParser()
    assert parser.feed(b'data: {"a"') == []
    assert parser.feed(b":1}\r") == []
    assert parser.feed(b"\n\r") == []
    assert parser.feed(b"\ndata: [DONE]\n\n") == [b'{"a":1}', b"[DONE]"]


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[bytes], bytes, list[int]]:
    payloads = [msgspec.json.encode(v) for v in draw(st.lists(json_values, max_size=8))]
    frames = []
    for payload in payloads:
        if draw(st.booleans()):
            frames.append(KEEPALIVE)
        frames.append(event(payload))
    frames.append(DONE)
    stream = b"".join(frames)
    if draw(st.booleans()):
        stream = stream.replace(b"\n", b"\r\n")
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    return [*payloads, b"[DONE]"], stream, cuts


@given(streams())
def test_chunked_stream_round_trips(case: tuple[list[bytes], bytes, list[int]]) -> None:
    expected, stream, cuts = case
    parser = SSEParser()
    got: list[bytes] = []
    bounds = [0, *cuts, len(stream)]
    for start, end in pairwise(bounds):
        got += parser.feed(stream[start:end])
    assert got == expected
    assert parse(stream) == expected

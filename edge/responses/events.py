"""The typed SSE events of a streamed response, which build the response object one change at
a time (`ResponseBuilder` in `output.py` sends them), and the JSON encoding of both.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .response import OutputItem, OutputText, Response


class _Event(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int


class ResponseEvent(_Event, kw_only=True):
    response: Response


class OutputItemEvent(_Event, kw_only=True):
    output_index: int
    item: OutputItem


class ItemProgressEvent(_Event, kw_only=True):
    """An event about one output item; the base of those about its content and arguments."""

    item_id: str
    output_index: int


class _ContentEvent(ItemProgressEvent, kw_only=True):
    content_index: int


class ContentPartEvent(_ContentEvent, kw_only=True):
    part: OutputText


class TextDeltaEvent(_ContentEvent, kw_only=True):
    delta: str
    logprobs: list[Any] = []


class TextDoneEvent(_ContentEvent, kw_only=True):
    text: str
    logprobs: list[Any] = []


class ArgumentsDeltaEvent(ItemProgressEvent, kw_only=True):
    delta: str


class ArgumentsDoneEvent(ItemProgressEvent, kw_only=True):
    arguments: str


class ErrorEvent(_Event, kw_only=True):
    code: str | None = None
    message: str
    param: str | None = None


_encoder = msgspec.json.Encoder()


def encode(value: Any) -> bytes:
    return _encoder.encode(value)

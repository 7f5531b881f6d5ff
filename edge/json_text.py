"""JSON inside a request's strings (a schema, a tool call's arguments) and JSON values taken
from its body into templates and grammars: nested at most `MAX_DEPTH` deep.

The body's own decoder stops at msgspec's nesting limit, but JSON text inside a string is
decoded later, by `json.loads`, which runs out of stack (a `RecursionError`, so a 500) on a few
kilobytes of `[[[[`; and a value nested almost as deep as the body decoder allows can still
exhaust the stack of whatever walks it next (re-encoding, a template, a grammar compiler)
from deeper in the call stack. No schema or call's arguments nest anywhere near this deep.

The depth is measured on the text, in C: string literals cut out by one regular expression
(possessive, so linear even on an unterminated string), the brackets left counted with numpy.
A 16 MiB body of any shape takes at most ~0.3 s on one core.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import numpy as np

MAX_DEPTH = 128

_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.S)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


class TooDeep(ValueError):
    """A JSON value nested more than `MAX_DEPTH` deep."""

    def __init__(self) -> None:
        super().__init__(f"nested more than {MAX_DEPTH} deep")


def loads(text: str | bytes, **options: Any) -> Any:
    """`json.loads(text, **options)`, refusing a value nested more than `MAX_DEPTH` deep.
    Raises `TooDeep` (a ValueError) for text that nests too deeply, JSON or not, and
    ValueError for other text that is not JSON."""
    if depth(text) > MAX_DEPTH:
        raise TooDeep
    return json.loads(text, **options)


def check_depth(value: Any) -> None:
    """Raise `TooDeep` if `value` (what a JSON decoder made) nests more than `MAX_DEPTH` deep."""
    try:
        text = msgspec.json.encode(value)
    except RecursionError:
        raise TooDeep from None
    if depth(text) > MAX_DEPTH:
        raise TooDeep


def nesting_error(text: str) -> str | None:
    """Why `text` nests too deeply; None for text that does not, JSON or not (callers pass
    text that is not JSON on as text)."""
    return str(TooDeep()) if depth(text) > MAX_DEPTH else None


def depth(text: str | bytes) -> int:
    """How deep the brackets outside string literals of JSON `text` nest at their deepest."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max())

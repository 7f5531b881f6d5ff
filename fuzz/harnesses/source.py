"""Structured values drawn from fuzz bytes.

A harness reads its input through a `ByteSource`: every draw consumes bytes from the front, and
an exhausted source keeps answering with zeros, so any input is a valid program of draws and
the same bytes always draw the same values. Small mutations of the bytes give small changes of
the values, which is what a mutation engine (ours or libFuzzer's) relies on.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

# Floats that break range checks: edges, infinities, NaN, negative zero, subnormals.
INTERESTING_FLOATS = (
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    2.0,
    100.0,
    1e-308,
    5e-324,
    1e308,
    -1e308,
    float("inf"),
    float("-inf"),
    float("nan"),
)

# Integers at the edges of the widths the wire and the tokenizer use.
INTERESTING_INTS = (
    0,
    1,
    -1,
    2,
    16,
    127,
    128,
    255,
    256,
    2**15,
    2**16 - 1,
    2**16,
    2**31 - 1,
    2**31,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    -(2**63),
    -(2**63) - 1,
    2**64 - 1,
    2**64,
    10**30,
)


class ByteSource:
    """Draws values from `data`, front to back."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    @property
    def remaining(self) -> int:
        return len(self.data) - self.pos

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1]

    def take(self, n: int) -> bytes:
        """Up to `n` bytes (fewer when the source runs out)."""
        chunk = self.data[self.pos : self.pos + max(n, 0)]
        self.pos += len(chunk)
        return chunk

    def rest(self) -> bytes:
        return self.take(self.remaining)

    def int(self, lo: int, hi: int) -> int:
        """An int in `[lo, hi]`, from as many bytes as the range needs."""
        span = hi - lo + 1
        if span <= 1:
            return lo
        width = (span.bit_length() + 7) // 8
        return lo + int.from_bytes(self.take(width), "little") % span

    def bool(self) -> bool:
        return bool(self.byte() & 1)

    def chance(self, one_in: int) -> bool:
        """True for about one input in `one_in`."""
        return self.byte() % one_in == 0

    def choice(self, options: Sequence[T]) -> T:
        return options[self.int(0, len(options) - 1)]

    def wide_int(self) -> int:
        """An interesting int, or any 64-bit pattern read signed or unsigned."""
        kind = self.byte() % 4
        if kind == 0:
            return self.choice(INTERESTING_INTS)
        raw = self.take(8).ljust(8, b"\0")
        return int.from_bytes(raw, "little", signed=kind == 1)

    def float(self) -> float:
        if self.bool():
            return self.choice(INTERESTING_FLOATS)
        return struct.unpack("<d", self.take(8).ljust(8, b"\0"))[0]

    def blob(self, max_size: int) -> bytes:
        """Length-prefixed bytes, at most `max_size`."""
        return self.take(self.int(0, max_size))

    def text(self, max_size: int) -> str:
        """A string of at most `max_size` bytes' worth, decoded in one of several ways.

        surrogateescape turns every invalid byte into a lone surrogate, which is not valid
        Unicode: whatever receives the string must cope with that.
        """
        raw = self.blob(max_size)
        how = self.byte() % 4
        if how == 0:
            return raw.decode("utf-8", "surrogateescape")
        if how == 1:
            return raw.decode("latin-1")
        if how == 2:
            return raw.decode("utf-16-le", "surrogatepass" if len(raw) % 2 == 0 else "replace")
        return raw.decode("utf-8", "replace")

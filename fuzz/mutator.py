"""The built-in mutation engine: seed inputs, changed a little at a time.

Without coverage feedback, the engine leans on good seeds (real captured messages) and on
stacking a few mutations per input: byte and bit flips, interesting values at every width,
insertions, deletions, duplicated ranges, splices of two inputs, truncation, and dictionary
tokens. Everything is drawn from one `random.Random`, so a seed gives the same inputs in the
same order on every machine.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence

MAX_INPUT = 1 << 17  # mutants grow by insertion; past this they are cut back
_POOL = 64  # recent mutants that may be mutated further
_STACK = (1, 1, 1, 2, 2, 3, 4, 6, 8)  # how many mutations one input gets
_INTERESTING_BYTES = (0x00, 0x01, 0x7F, 0x80, 0xFF, 0x0A, 0x0D, 0x20, 0x22, 0x5C, 0xC0, 0xDC)
_INTERESTING_INTS = (
    0,
    1,
    -1,
    2,
    16,
    32,
    64,
    100,
    127,
    128,
    255,
    256,
    1000,
    1024,
    4096,
    2**15,
    2**16 - 1,
    2**16,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
)


class Mutator:
    """Yields inputs: first every seed as it is, then mutants of seeds and of earlier mutants."""

    def __init__(
        self, rng: random.Random, seeds: Sequence[bytes], dictionary: Sequence[bytes] = ()
    ) -> None:
        self.rng = rng
        self.seeds = list(seeds) or [b""]
        self.dictionary = [token for token in dictionary if token]
        self.pool: deque[bytes] = deque(maxlen=_POOL)
        self._pending = list(seeds)

    def __iter__(self) -> Mutator:
        return self

    def __next__(self) -> bytes:
        if self._pending:
            return self._pending.pop(0)
        rng = self.rng
        roll = rng.random()
        if roll < 0.03:
            base = rng.randbytes(rng.randrange(256))
        elif roll < 0.25 and self.pool:
            base = rng.choice(self.pool)
        else:
            base = rng.choice(self.seeds)
        data = bytearray(base)
        for _ in range(rng.choice(_STACK)):
            self._mutate(data)
        del data[MAX_INPUT:]
        mutant = bytes(data)
        self.pool.append(mutant)
        return mutant

    def _mutate(self, data: bytearray) -> None:
        rng = self.rng
        op = rng.randrange(12)
        pos = rng.randrange(len(data) + 1)
        if op == 0 and data:  # flip a bit
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        elif op == 1 and data:  # a random or an interesting byte
            i = rng.randrange(len(data))
            data[i] = rng.choice(_INTERESTING_BYTES) if rng.random() < 0.5 else rng.randrange(256)
        elif op == 2 and data:  # a small step up or down
            i = rng.randrange(len(data))
            data[i] = (data[i] + rng.choice((-3, -2, -1, 1, 2, 3))) % 256
        elif op == 3:  # an interesting int, at any width and byte order
            width = rng.choice((1, 2, 4, 8))
            value = rng.choice(_INTERESTING_INTS) % (1 << (8 * width))
            raw = value.to_bytes(width, rng.choice(("little", "big")))
            data[pos : pos + width] = raw
        elif op == 4:  # insert random bytes
            data[pos:pos] = rng.randbytes(rng.choice((1, 1, 2, 4, 8, 32)))
        elif op == 5 and self.dictionary:  # insert or overwrite with a dictionary token
            token = rng.choice(self.dictionary)
            end = pos + (len(token) if rng.random() < 0.5 else 0)
            data[pos:end] = token
        elif op == 6 and data:  # delete a range
            del data[pos : pos + rng.choice((1, 1, 2, 4, 16, 128))]
        elif op == 7 and data:  # duplicate a range in place
            start = rng.randrange(len(data))
            data[pos:pos] = data[start : start + rng.choice((1, 4, 16, 256))]
        elif op == 8:  # splice: this input's head, another's tail
            other = rng.choice(self.seeds)
            data[pos:] = other[rng.randrange(len(other) + 1) :]
        elif op == 9 and data:  # truncate
            del data[pos:]
        elif op == 10 and data:  # repeat a byte many times (oversized lengths and frames)
            start = rng.randrange(len(data))
            data[start:start] = data[start : start + 1] * rng.choice((64, 1024, 65536))
        elif data:  # overwrite a range with a copy of another part of the input
            start, size = rng.randrange(len(data)), rng.choice((1, 2, 4, 8, 32))
            data[pos : pos + size] = data[start : start + size]


def libfuzzer_dictionary(tokens: Sequence[bytes]) -> str:
    """`tokens` in libFuzzer's `-dict` file format."""
    lines = []
    for token in tokens:
        escaped = "".join(
            chr(b) if 0x20 <= b < 0x7F and b not in b'"\\' else f"\\x{b:02x}" for b in token
        )
        lines.append(f'"{escaped}"')
    return "\n".join(lines) + "\n"

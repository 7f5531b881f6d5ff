"""In-process fuzz harnesses, one module per decoder or parser.

Each module has `test_one_input(data: bytes) -> None`. A harness catches exactly the errors its
target documents for bad input, checks them (a `ProtocolError`, a 4xx `APIError`, a
`ValueError`), and checks invariants on whatever succeeds; anything that escapes it is a bug.
A module may also have `DICTIONARY`, tokens that the mutation engines splice into inputs.

Importing this package imports no harness: `load` does, so that a coverage-instrumenting engine
can instrument the code under test as it is first imported.
"""

from __future__ import annotations

import importlib
from types import ModuleType

HARNESSES = (
    "wire",
    "http_body",
    "auth",
    "sse",
    "chat",
    "scheduler",
    "shm_ring",
    "kv_server",
    "kv_seal",
)


def load(name: str) -> ModuleType:
    """The harness module `name`; KeyError for a name not in `HARNESSES`."""
    if name not in HARNESSES:
        raise KeyError(f"no harness {name!r}; the harnesses are {', '.join(HARNESSES)}")
    return importlib.import_module(f"{__name__}.{name}")

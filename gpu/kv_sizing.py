"""The KV cache's size: what `kv_cache_memory` "auto" takes from the machine, and how long a
sequence a cache of some size lets the model serve.

"auto" (kept as 0 in `EngineArgs`) is decided once the weights are loaded, from what the machine
has left: on a CPU, 25% of the memory available (/proc/meminfo's MemAvailable, or a cgroup v2
limit's headroom where that is smaller), shared by the ranks of a parallel world; on a GPU, 80%
of the device's free memory. Either within [256 MiB, 8 GiB], and never more than every sequence
at full length needs (`max_num_seqs` x `max_model_len` tokens). Where the model's own context
does not fit what the cache holds, the runner serves a shorter `max_model_len`, in whole blocks
(`fitted_max_model_len`); a `max_model_len` that was asked for and does not fit is an error,
and where a size was asked for too, the model check says so before a start from the model's
files alone (`KVCacheAsked`, `checks/model.py`), which is why this module is pure Python.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

MiB, GiB = 1 << 20, 1 << 30
AUTO = 0  # `kv_cache_memory` "auto", as `EngineArgs` keeps it

# A quarter on a CPU: MemAvailable counts the page cache as free, and a GGUF file's weights are
# read in place from it (`gguf_file`), so the weights' pages, a step's activations and every
# other process of the machine keep three quarters. The cache's pages are taken as its blocks
# first fill (`kv_memory`): the share bounds what a busy server takes, not what a start takes.
# A GPU's free memory after the weights is the device's alone: most of it, less what a step's
# activations and the allocator's fragmentation need.
CPU_SHARE = 0.25
CUDA_SHARE = 0.8
# The floor: a small model's whole context for a handful of sequences, so that a machine short
# of memory still serves (as the former fixed 512 MiB default did). The ceiling: a decode step
# reads every running sequence's keys and values, and past 8 GiB of them a CPU's memory
# bandwidth (some 100 ms a step), not the cache's size, limits the batch; on a GPU too it keeps
# "auto" modest beside other work. A larger cache is one flag away.
AUTO_MIN, AUTO_MAX = 256 * MiB, 8 * GiB


@dataclass(frozen=True)
class KVGeometry:
    """One rank's KV cache per block: keys and values of `layers` layers, `kv_heads` heads of
    `head_dim` values each, `itemsize` bytes a value, `block_size` tokens a block."""

    layers: int
    kv_heads: int
    head_dim: int
    itemsize: int
    block_size: int

    @property
    def block_bytes(self) -> int:
        return 2 * self.layers * self.block_size * self.kv_heads * self.head_dim * self.itemsize

    def bytes_for(self, tokens: int) -> int:
        """The bytes of the whole blocks that hold `tokens` tokens."""
        return -(-tokens // self.block_size) * self.block_bytes


@dataclass(frozen=True)
class KVLimits:
    """What a rank's cache is sized by: `memory` bytes (`AUTO`: from the machine), the
    `max_model_len` to serve, whether it was `given` (asked for: never lowered, an error where
    it does not fit; else the model's own context, lowered to what fits), and `max_num_seqs`."""

    memory: int
    max_model_len: int
    given: bool
    max_num_seqs: int


def size_kv_cache(
    geometry: KVGeometry,
    limits: KVLimits,
    device: Any,
    layout: Any,
    world_min: Callable[[int], int],
) -> tuple[int, int]:
    """(blocks, max_model_len) of one rank's cache on `device` (a `torch.device`), in a world of
    `layout` (a `parallel_state.ParallelLayout`) whose ranks each call this at once:
    `world_min` is their collective smallest value. Every rank takes the world's fewest blocks
    (the scheduler's blocks must fit in each); rank 0 logs what "auto" chose and any lowering.
    ValueError where a `max_model_len` asked for does not fit (`fitted_max_model_len`)."""
    announce, memory = layout.rank == 0, limits.memory
    if memory == AUTO:
        world_min(0)  # a barrier: every rank measures once every rank's weights are in
        needed = limits.max_num_seqs * geometry.bytes_for(limits.max_model_len)
        memory = device_kv_memory(device, needed, layout.world_size, announce=announce)
    num_blocks = world_min(memory // geometry.block_bytes)
    length = fitted_max_model_len(
        geometry, num_blocks, memory, limits.max_model_len, given=limits.given, announce=announce
    )
    return num_blocks, length


# the bytes of a cached value at each dtype; "auto" is bfloat16 or float32 as the machine
# decides at start, so a check before it counts the smaller: it refuses only what never fits
ITEMSIZES = {"auto": 2, "float32": 4, "bfloat16": 2, "float16": 2}


class KVSizes(NamedTuple):
    """What a model's KV cache is sized by: its context length, layers, KV heads, head size."""

    context: int
    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(
        cls,
        context: Any,
        layers: Any,
        kv_heads: Any,
        head_dim: Any,
        *,
        hidden_size: Any = None,
        heads: Any = None,
    ) -> KVSizes | None:
        """The sizes as a config or a GGUF header gives them, the head size where it gives none
        `hidden_size` / `heads`; None where one is not known (not a positive integer)."""
        if head_dim is None and _positive(hidden_size, heads):
            head_dim = hidden_size // heads
        values = (context, layers, kv_heads, head_dim)
        return cls(*values) if _positive(*values) else None


def config_kv_sizes(config: dict[str, Any]) -> KVSizes | None:
    """The KV sizes a model's config.json gives (None: not all of them)."""
    heads = config.get("num_attention_heads")
    return KVSizes.of(
        config.get("max_position_embeddings"),
        config.get("num_hidden_layers"),
        config.get("num_key_value_heads") or heads,
        config.get("head_dim"),
        hidden_size=config.get("hidden_size"),
        heads=heads,
    )


@dataclass(frozen=True)
class KVCacheAsked:
    """A `--kv-cache-memory` (bytes per rank) and a `--max-model-len` both given, with what
    shapes a rank's cache: the dtype, the parallel world, the block size."""

    memory: int
    max_model_len: int
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    block_size: int = 16

    def problem(self, sizes: KVSizes | None) -> str | None:
        """Why a model of `sizes` (None: not known) can never serve `max_model_len` (capped at
        its context, as the runner caps it) in `memory` bytes, in the runner's words, or None:
        in the largest rank's cache (layers split by stage, KV heads by tensor rank) at the
        dtype's smallest size."""
        if sizes is None:
            return None
        layers = -(-sizes.layers // self.pipeline_parallel_size)
        kv_heads = max(1, sizes.kv_heads // self.tensor_parallel_size)
        itemsize = ITEMSIZES[self.dtype]
        geometry = KVGeometry(layers, kv_heads, sizes.head_dim, itemsize, self.block_size)
        return never_fits(self.memory, min(self.max_model_len, sizes.context), geometry)


def _positive(*values: object) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


def auto_kv_memory(available: int, share: float, needed: int) -> int:
    """The bytes "auto" gives the cache: `share` of `available`, within [AUTO_MIN, AUTO_MAX],
    and no more than `needed` (every sequence at full length)."""
    return min(max(AUTO_MIN, min(AUTO_MAX, int(available * share))), needed)


def too_small(memory: int, tokens: int, max_model_len: int, needed: int) -> str:
    """Why a cache of `memory` bytes, holding `tokens` tokens, cannot serve `max_model_len`
    (`needed` bytes would)."""
    return (
        f"kv_cache_memory of {memory} bytes holds {tokens} tokens, less than max_model_len "
        f"{max_model_len}: give it at least {needed} bytes or lower max_model_len"
    )


def never_fits(memory: int, max_model_len: int, geometry: KVGeometry) -> str | None:
    """Why a cache of `memory` bytes of `geometry` cannot serve `max_model_len`, in the words
    of the runner's refusal (`too_small`), or None where it can."""
    holds = memory // geometry.block_bytes * geometry.block_size
    if holds >= max_model_len:
        return None
    return too_small(memory, holds, max_model_len, geometry.bytes_for(max_model_len))


def fitted_max_model_len(
    geometry: KVGeometry,
    num_blocks: int,
    memory: int,
    max_model_len: int,
    *,
    given: bool,
    announce: bool = True,
) -> int:
    """The `max_model_len` a cache of `num_blocks` blocks (sized from `memory` bytes) serves:
    `max_model_len` where it fits; else, where it is the model's own (not `given`), the whole
    blocks the cache holds, with one warning (where `announce`: one rank of a world says it).
    ValueError where a given one does not fit, or the cache holds fewer than 2 tokens."""
    holds = num_blocks * geometry.block_size
    if holds >= max_model_len:
        return max_model_len
    needed = geometry.bytes_for(max_model_len)
    if given or holds < 2:
        raise ValueError(too_small(memory, holds, max_model_len, needed))
    if announce:
        log.warning(
            "the model's context of %d tokens does not fit the %s KV cache: serving "
            "max_model_len %d, what it holds; for the whole context give --kv-cache-memory %s "
            "or more, or choose a length with --max-model-len",
            max_model_len,
            _size(memory),
            holds,
            _size(needed, up=True),
        )
    return holds


def device_kv_memory(device: Any, needed: int, ranks: int, *, announce: bool = True) -> int:
    """The bytes "auto" gives one rank's cache on `device` (a `torch.device`), measured now:
    after the weights are loaded. `needed` is what every sequence at full length takes; on a
    CPU the `ranks` of a world share the machine's memory, each taking its part of the share.
    Logs the choice (where `announce`: one rank of a world says it)."""
    if device.type == "cuda":
        # only a GPU's runner gets here: the pre-start check imports this module without torch
        import torch

        torch.cuda.empty_cache()  # what loading freed counts as free
        available, share, where = torch.cuda.mem_get_info(device)[0], CUDA_SHARE, "free on GPU"
    else:
        available, share, where = cpu_available_memory(), CPU_SHARE / ranks, "available"
    memory = auto_kv_memory(available, share, needed)
    if announce:
        capped = ", capped at what every sequence at full length needs" if memory == needed else ""
        log.info(
            "KV cache: %s per rank, auto: %g%% of the %s %s after the weights, within %s to "
            "%s%s (--kv-cache-memory sets it)",
            _size(memory),
            share * 100,
            _size(available),
            where,
            _size(AUTO_MIN),
            _size(AUTO_MAX),
            capped,
        )
    return memory


def cpu_available_memory(
    meminfo: Path = Path("/proc/meminfo"),
    cgroup: Path = Path("/proc/self/cgroup"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
) -> int:
    """The memory this process may still take: MemAvailable, or its cgroup v2 limit's headroom
    (memory.max less memory.current) where that is smaller, as a container's limit is."""
    available = meminfo_available(meminfo.read_text())
    headroom = cgroup_headroom(cgroup, cgroup_root)
    return available if headroom is None else min(available, headroom)


def meminfo_available(text: str) -> int:
    """MemAvailable of /proc/meminfo's `text`, in bytes."""
    match = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE)
    if match is None:
        raise ValueError("/proc/meminfo has no MemAvailable (a Linux kernel before 3.14?)")
    return int(match.group(1)) << 10


def cgroup_headroom(cgroup: Path, cgroup_root: Path) -> int | None:
    """memory.max less memory.current of this process's cgroup v2 group, or None where it has
    no limit (`max`) or is not under cgroup v2."""
    try:
        groups = cgroup.read_text().splitlines()
    except OSError:
        return None
    path = next((line[3:] for line in groups if line.startswith("0::")), None)
    if path is None:
        return None
    group = cgroup_root / path.lstrip("/")
    try:
        limit = (group / "memory.max").read_text().strip()
        current = int((group / "memory.current").read_text())
    except (OSError, ValueError):
        return None
    if limit == "max":
        return None
    return max(0, int(limit) - current)


def _size(nbytes: int, *, up: bool = False) -> str:
    """ "576MiB", "1.5GiB": a size as --kv-cache-memory takes it (`up`: never less than
    `nbytes`, for a size to give)."""
    for unit, name in ((1 << 10, "KiB"), (MiB, "MiB")):
        if nbytes < unit << 10:
            return f"{-(-nbytes // unit) if up else nbytes // unit}{name}"
    tenths = -(-nbytes * 10 // GiB) if up else round(nbytes * 10 / GiB)
    return f"{tenths / 10:g}GiB"

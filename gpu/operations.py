"""The administrative operations of one model worker rank: sleep and wake (memory given back to
the operating system), new weights (a checkpoint from disk, or a trainer's tensors pushed between
`start_weight_update` and `finish_weight_update`), LoRA adapters added and removed, and
profiling.

The engine core calls them by name (`triode.wire.WorkerCall`, whose method must be in
`Operations.METHODS`) on every rank, only between steps and from the thread that runs the
runner's steps or one that takes turns with it, so nothing here locks. Each returns a msgpack-able
dict with at least this process's `pid` and `rss_bytes` after the operation (see
`memory.memory_report`), or raises `OperationError` (`invalid`, `conflict`, `unsupported`) having
changed nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from triode.wire import OperationError

from .lora.store import LoraStore
from .memory import free_model, memory_report, model_tensors, release_memory, tensor_bytes
from .model_files import checkpoint_weights
from .model_runner import ModelRunner
from .profiling import Profiler
from .weight_transfer import WeightTransfer
from .weight_updates import Architecture, write_weights

SLEEP_TAGS = ("kv_cache", "weights")
WEIGHTS_ASLEEP = "the weights are asleep: wake_up with tags=weights first"


class Operations:
    """The operations on `runner`, and what they leave behind: which parts sleep, where the
    weights come from on waking (the runner's model directory, or the last checkpoint given to
    `update_weights_from_disk`), whether a pushed update is open, and the running profile.
    LoRA adapters live in the runner's `LoraStore`, which outlives a rebuilt model."""

    METHODS: frozenset[str] = frozenset(
        {
            "sleep",
            "wake_up",
            "update_weights_from_disk",
            "start_weight_update",
            "apply_weights",
            "finish_weight_update",
            "start_profile",
            "stop_profile",
            "memory",
            "init_weight_transfer",
            "update_weights",
            "add_lora",
            "remove_lora",
        }
    )

    # what an encoder (`EncoderRunner`: no KV cache, no adapters, weights as loaded) takes
    ENCODER_METHODS: frozenset[str] = frozenset({"start_profile", "stop_profile", "memory"})

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.source = runner.model_dir  # what waking loads the weights from
        self._kv_shape = tuple(runner.kv_cache.shape)
        self._architecture: Architecture | None = None
        self._update: _Update | None = None  # a pushed update between start and finish
        self._profiler = Profiler(runner.device, runner.parallel.rank)
        # a trainer's pushes: the transport's state (shm, or a broadcast group joined)
        self._transfer = WeightTransfer(
            self.apply_weights,
            rank=runner.parallel.rank,
            device=runner.device,
            check=self.check_weights,
        )

    def call(self, method: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`method` (one of `METHODS`: a `WorkerCall`'s) with `kwargs`; RuntimeError for
        any other name."""
        if method not in self.METHODS:
            raise RuntimeError(f"no operation {method[:64]!r}")
        if self.runner.whole_prompts and method not in self.ENCODER_METHODS:
            raise OperationError(
                "unsupported", f"{method}: the encoder served here (embeddings, scores) has none"
            )
        result: dict[str, Any] = getattr(self, method)(**kwargs)
        return result

    # --- sleep ----------------------------------------------------------------------------------

    def sleep(self, tags: list[str]) -> dict[str, Any]:
        """Free the KV cache and/or the weights and give their memory back to the system;
        returns `freed_bytes` (the tensors' bytes), `asleep` (every part asleep now) and, with
        weights, `model_path`, what waking loads them from.

        A KV cache that sleeps wakes zeroed: the engine core forgets what it cached. Weights
        wake as their source holds them: what a push wrote since is gone. With a KV
        connector the cache is registered with its transport and may not sleep
        (`unsupported`); a part asleep already, or the weights during a pushed update, is a
        `conflict`.
        """
        wanted = self._tags(tags)
        runner = self.runner
        already = wanted & runner.sleeping
        if already:
            raise OperationError("conflict", f"{', '.join(sorted(already))} asleep already")
        if "kv_cache" in wanted and runner.kv_connector is not None:
            raise OperationError(
                "unsupported", "the KV cache is registered with the KV connector: it cannot sleep"
            )
        if "weights" in wanted and self._update is not None:
            raise OperationError("conflict", "a weight update is open: finish it first")
        freed = 0
        if "kv_cache" in wanted:
            freed += tensor_bytes([runner.kv_cache])
            runner.kv_cache = torch.empty(0)
            runner.bind_kv_cache()
        extra: dict[str, Any] = {}
        if "weights" in wanted:
            freed += tensor_bytes(model_tensors(runner.model))
            free_model(runner.model)
            extra["model_path"] = str(self.source)
        runner.sleeping |= wanted
        release_memory(runner.device)
        return self._report(freed_bytes=freed, asleep=sorted(runner.sleeping), **extra)

    def wake_up(self, tags: list[str]) -> dict[str, Any]:
        """Bring sleeping parts back: the KV cache zeroed, of its old shape; the weights
        rebuilt from their source as at start (the KV cache's views rebound to the new
        layers). Returns `allocated_bytes`, `asleep` and, with weights, `model_path`. A part
        that is awake is a `conflict`."""
        wanted = self._tags(tags)
        runner = self.runner
        awake = wanted - runner.sleeping
        if awake:
            raise OperationError("conflict", f"{', '.join(sorted(awake))} not asleep")
        extra: dict[str, Any] = {}
        if "weights" in wanted:
            try:
                runner.load_model(self.source)  # binds the KV cache's views, awake or not
            except BaseException:
                release_memory(runner.device)  # the half-built model: still asleep
                raise
            runner.sleeping -= {"weights"}
            extra["model_path"] = str(self.source)
        if "kv_cache" in wanted:
            runner.kv_cache = torch.zeros(self._kv_shape, dtype=runner.dtype, device=runner.device)
            runner.bind_kv_cache()
            runner.sleeping -= {"kv_cache"}
        allocated = tensor_bytes([runner.kv_cache]) if "kv_cache" in wanted else 0
        if "weights" in wanted:
            allocated += tensor_bytes(model_tensors(runner.model))
            release_memory(runner.device)  # the loading's own transient blocks
        return self._report(allocated_bytes=allocated, asleep=sorted(runner.sleeping), **extra)

    @staticmethod
    def _tags(tags: list[str]) -> frozenset[str]:
        if not isinstance(tags, list) or not tags:
            raise OperationError("invalid", f"tags must be a non-empty list of {SLEEP_TAGS}")
        unknown = [t for t in tags if t not in SLEEP_TAGS]
        if unknown:
            raise OperationError("invalid", f"unknown tags {unknown}; known: {SLEEP_TAGS}")
        return frozenset(tags)

    # --- new weights ----------------------------------------------------------------------------

    def update_weights_from_disk(self, model_path: str) -> dict[str, Any]:
        """Load the weights of checkpoint directory `model_path`, checked first in full (config,
        every tensor's name, shape and dtype, every tensor the model needs; `invalid` and the
        old weights keep serving otherwise), and make it the weights' source. While the
        weights sleep it only becomes the source, which waking loads (`loaded` False).

        The config's other fields (context length, end-of-sequence ids) stay the running
        model's. Returns `model_path`, `loaded`, `tensors` (parameters written),
        `int4_detached` and `int4_attached` (projections that dropped the old checkpoint's
        weights as GGUF stored them, and took the new one's, as a start on it does)."""
        if self._update is not None:
            raise OperationError("conflict", "a pushed weight update is open: finish it first")
        if not isinstance(model_path, str) or not model_path:
            raise OperationError("invalid", "model_path must be a checkpoint directory's path")
        runner = self.runner
        path = Path(model_path).expanduser().absolute()
        names = self._checked_architecture().check_checkpoint(path, runner.model)
        result: dict[str, Any] = {"model_path": str(path), "loaded": False, "tensors": 0}
        if "weights" in runner.sleeping:
            self.source = path
            return self._report(**result, int4_detached=0, int4_attached=0)
        written, detached = write_weights(runner.model, checkpoint_weights(path), names)
        runner.quantized_projections -= detached
        runner.pack_weights()
        with torch.no_grad():
            attached = runner.attach_quantized(path)
        runner.quantized_projections += attached
        self.source = path
        release_memory(runner.device)
        result |= {"loaded": True, "tensors": written}
        return self._report(**result, int4_detached=detached, int4_attached=attached)

    def start_weight_update(self) -> dict[str, Any]:
        """Open an update pushed in buckets (`apply_weights`), closed by
        `finish_weight_update`; `conflict` while one is open or the weights sleep."""
        if "weights" in self.runner.sleeping:
            raise OperationError("conflict", WEIGHTS_ASLEEP)
        if self._update is not None:
            raise OperationError("conflict", "a weight update is open already")
        self._checked_architecture()
        self._update = _Update()
        return self._report()

    def apply_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """Write one bucket of an open update: (Hugging Face name, full tensor) pairs, any
        floating dtype (cast to the model's). The whole bucket is checked before anything is
        written: a name that is no parameter of the architecture, a wrong shape or a
        non-floating dtype is `invalid`, naming it. Another pipeline stage's tensors, and a
        tied model's `lm_head.weight`, are accepted and skipped. Returns `tensors` (this
        rank's parameters written)."""
        update = self._open_update()
        bucket = list(weights)  # bounded by the transport's bucket size
        model = self.runner.model
        self._checked_architecture().check_tensors(bucket, model)
        written, detached = write_weights(model, bucket, [name for name, _ in bucket])
        self.runner.quantized_projections -= detached
        update.tensors += written
        update.int4_detached += detached
        return self._report(tensors=written)

    def check_weights(self, specs: Iterable[tuple[str, torch.dtype, Sequence[int]]]) -> None:
        """What `apply_weights` checks, on (name, dtype, shape) before the tensors exist: a
        transport refuses a bucket before receiving it. Not a `WorkerCall` method."""
        self._open_update()
        self._checked_architecture().check_specs(list(specs), self.runner.model)

    def _open_update(self) -> _Update:
        if "weights" in self.runner.sleeping:
            raise OperationError("conflict", WEIGHTS_ASLEEP)
        if self._update is None:
            raise OperationError("conflict", "no weight update is open: start_weight_update")
        return self._update

    def finish_weight_update(self) -> dict[str, Any]:
        """Close the open update: the projections that took new weights are packed again for
        the CPU (where the runner packs them). Returns `tensors` (parameters written over the
        update), `int4_detached` (projections that lost their 4-bit codes) and `packed`."""
        update = self._open_update()
        self._update = None
        packed = self.runner.pack_weights()
        release_memory(self.runner.device)  # the plain weights that packing replaced
        return self._report(
            tensors=update.tensors, int4_detached=update.int4_detached, packed=packed
        )

    def _checked_architecture(self) -> Architecture:
        if self._architecture is None:  # built on first use: it costs start-up nothing
            self._architecture = Architecture(self.runner.config)
        return self._architecture

    def init_weight_transfer(self, init_info: dict[str, Any], rank_offset: int) -> dict[str, Any]:
        """Set up a trainer's transport (`WeightTransfer.init`): for the broadcast, join its
        group as rank `rank_offset` + this rank, blocking until the whole group has."""
        return self._report(**self._transfer.init(init_info, rank_offset))

    def update_weights(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """One bucket of an open update through the transport, into `apply_weights`."""
        return self._transfer.update(update_info)

    def close(self) -> None:
        """Leave a trainer's broadcast group, if one was joined."""
        self._transfer.close()

    # --- LoRA adapters --------------------------------------------------------------------------

    def add_lora(self, lora_id: int, path: str, digest: str | None = None) -> dict[str, Any]:
        """Read the PEFT adapter directory `path`, check it against this model and the LoRA
        limits, and keep this rank's share (tensor-parallel cut, pipeline stage's layers) under
        `lora_id` (`LoraStore.add`), weights awake or asleep. Returns `digest` (hex SHA-256 of
        its files, `adapter_digest`), `rank`, `targets` (the projections it targets, Hugging
        Face names, sorted) and `bytes` (this rank's share).

        `invalid` for a bad adapter, naming the problem, or files whose digest is not `digest`
        ("changed on disk"); `conflict` for an id resident already or when `max_cpu_loras`
        are; `unsupported` where LoRA is off."""
        return self._report(**self._lora_store().add(lora_id, path, digest))

    def remove_lora(self, lora_ids: list[int]) -> dict[str, Any]:
        """Drop the adapters `lora_ids` (unknown ids are ignored); returns `resident`, how
        many stay."""
        if not isinstance(lora_ids, list):
            raise OperationError("invalid", "lora_ids must be a list of adapter ids")
        resident = self._lora_store().remove(lora_ids)
        release_memory(self.runner.device)
        return self._report(resident=resident)

    def _lora_store(self) -> LoraStore:
        if self.runner.lora is None:
            raise OperationError("unsupported", "LoRA adapters are off: start with --enable-lora")
        return self.runner.lora

    # --- profiling ------------------------------------------------------------------------------

    def start_profile(self, directory: str, prefix: str) -> dict[str, Any]:
        """Start a torch profile of every thread of this process (CPU, and CUDA on a GPU,
        with shapes and stacks); `conflict` while one runs, `invalid` for a directory that
        cannot be written or a prefix with a path separator. Returns `file`, where
        `stop_profile` will write it."""
        path = self._profiler.start(directory, prefix)
        return self._report(file=str(path))

    def stop_profile(self) -> dict[str, Any]:
        """Stop the profile and write its Chrome trace to `{directory}/{prefix}rank-{R}.json`
        (R this rank); returns `files`, that path. `conflict` when none runs."""
        path = self._profiler.stop()
        return self._report(files=[str(path)])

    # --- memory ---------------------------------------------------------------------------------

    def memory(self) -> dict[str, Any]:
        """This process's pid and resident set (and torch's device memory on CUDA)."""
        return self._report(asleep=sorted(self.runner.sleeping))

    def _report(self, **fields: Any) -> dict[str, Any]:
        return memory_report(self.runner.device) | fields


class _Update:
    """What an open pushed update has written so far."""

    def __init__(self) -> None:
        self.tensors = 0
        self.int4_detached = 0

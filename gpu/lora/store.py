"""The adapters resident on one rank, by id, and the step's runs of them.

Adapter tensors live here, outside the model's modules, keyed by id and projection name: they
outlive the model the runner rebuilds (waking from a sleep that freed the weights, a checkpoint
loaded from disk) and stay while the weights sleep. `share` hands each new model's projections
the one `LoraRuns` the runner sets per step, and a slot that indexes every adapter's pairs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from triode.wire import OperationError

from .adapter import Adapter, read_adapter
from .config import LoraLimits
from .punica import LoraRuns, SlotWeights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LoraStore:
    """Up to `limits.max_cpu_loras` adapters, each this rank's share, and the step's runs."""

    def __init__(
        self, config: Mapping[str, Any], model_dtype: torch.dtype, device: torch.device
    ) -> None:
        self.limits = LoraLimits.from_config(config)
        self.dtype = _DTYPES.get(self.limits.lora_dtype, model_dtype)
        self.device = device
        self.adapters: dict[int, Adapter] = {}
        self.runs = LoraRuns()
        self._model: nn.Module | None = None
        self._slots: dict[str, int] = {}  # projection name -> slot
        self._by_slot: dict[int, SlotWeights] = {}  # lora id -> its pairs by slot

    def share(self, model: nn.Module) -> None:
        """Give every LoRA-capable projection of `model` (a new one: at start, after a
        rebuild) the shared runs and its slot."""
        self._model = model
        self._slots = {}
        for name, module in model.named_modules():
            if isinstance(getattr(type(module), "lora", None), LoraRuns):  # `LinearBase`
                module.lora_slot = self._slots.setdefault(name, len(self._slots))
                module.lora = self.runs
        self._by_slot = {i: self._slot_weights(a) for i, a in self.adapters.items()}

    def add(self, lora_id: int, path: str, digest: str | None = None) -> dict[str, Any]:
        """Read, check and keep the adapter at `path` under `lora_id`; the worker operation's
        result (see `Operations.add_lora`). `conflict` for an id resident already or when
        `max_cpu_loras` are; `invalid` for a bad id, path or adapter, having changed nothing."""
        if not isinstance(lora_id, int) or isinstance(lora_id, bool) or lora_id < 1:
            raise OperationError("invalid", f"lora_id must be a positive integer, not {lora_id!r}")
        if not isinstance(path, str) or not path:
            raise OperationError("invalid", "path must be a LoRA adapter directory's path")
        if lora_id in self.adapters:
            raise OperationError("conflict", f"LoRA {lora_id} is resident already: remove it first")
        if len(self.adapters) >= self.limits.max_cpu_loras:
            raise OperationError(
                "conflict",
                f"{len(self.adapters)} LoRA adapters are resident, the most --max-cpu-loras "
                "allows: remove one first",
            )
        assert self._model is not None, "share a model first"
        adapter = read_adapter(
            Path(path),
            self._model,
            max_rank=self.limits.max_lora_rank,
            dtype=self.dtype,
            device=self.device,
            digest=digest,
        )
        self.adapters[lora_id] = adapter
        self._by_slot[lora_id] = self._slot_weights(adapter)
        return {
            "digest": adapter.digest,
            "rank": adapter.rank,
            "targets": adapter.targets,
            "bytes": adapter.nbytes,
        }

    def remove(self, lora_ids: Iterable[int]) -> int:
        """Drop the adapters `lora_ids` (unknown ids are ignored); returns how many stay."""
        for lora_id in lora_ids:
            self.adapters.pop(lora_id, None)
            self._by_slot.pop(lora_id, None)
        return len(self.adapters)

    def start_step(self, runs: list[tuple[int, int, int]]) -> None:
        """Set the step's runs ([lo, hi) rows, lora id). KeyError for an adapter that is not
        resident, ValueError for more than `max_loras` adapters: scheduler bugs."""
        ids = {lora_id for _, _, lora_id in runs}
        missing = sorted(ids - set(self._by_slot))
        if missing:
            raise KeyError(f"LoRA adapters {missing} are not resident: add_lora first")
        if len(ids) > self.limits.max_loras:
            raise ValueError(f"{len(ids)} LoRA adapters in one step, over max_loras")
        self.runs.runs = [(lo, hi, self._by_slot[lora_id]) for lo, hi, lora_id in runs]

    def _slot_weights(self, adapter: Adapter) -> SlotWeights:
        weights: SlotWeights = [None] * len(self._slots)
        for name, pair in adapter.modules.items():
            weights[self._slots[name]] = pair
        return weights


def start_lora_step(store: LoraStore | None, runs: list[tuple[int, int, int]]) -> None:
    """The step's adapter runs into `store`; KeyError for adapter rows where LoRA is off."""
    if store is not None:
        store.start_step(runs)
    elif runs:
        raise KeyError("a request names a LoRA adapter, but LoRA is not enabled")

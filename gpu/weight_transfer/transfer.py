"""One model worker rank's side of weight transfer: the backend `/init_weight_transfer_engine`
chose, and each `/update_weights` turned into (name, full tensor) pairs for the rank's loader.

The loader (`Operations.apply_weights`) validates a whole bucket before it loads any of it, so a
bucket is applied whole or not at all. With the broadcast backend a refused bucket is still
received to its end (by `check` before anything is allocated, else by receiving it all first),
so the trainer's broadcasts complete and the group stays in step for the next bucket; only an
`update_info` that does not even decode leaves the engine unable to tell what the trainer
sends, and then it closes the group, which fails the trainer's broadcast at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from triode.wire.operations import OperationError
from triode.wire.weight_update import (
    BroadcastInit,
    BroadcastUpdate,
    ShmUpdate,
    decode_init_info,
    decode_update_info,
)

from .broadcast import BroadcastGroup
from .shm import mapped_weights

# Loads (name, full tensor) pairs into the rank's parameters; raises OperationError("invalid")
# for a name, shape or dtype the model does not have, having loaded nothing.
Apply = Callable[[list[tuple[str, torch.Tensor]]], dict[str, Any]]
# Validates (name, dtype, shape) of a bucket before its data exists; raises as `Apply` does.
Check = Callable[[list[tuple[str, torch.dtype, tuple[int, ...]]]], None]


class WeightTransfer:
    """The weight-transfer state of engine rank `rank` (its rank among its engine core's ranks)
    whose model lives on `device`; calls come one at a time."""

    def __init__(
        self, apply: Apply, *, rank: int, device: torch.device, check: Check | None = None
    ) -> None:
        self._apply = apply
        self._check = check
        self._rank = rank
        self._device = device
        self._backend: str | None = None
        self._group: BroadcastGroup | None = None

    @property
    def backend(self) -> str | None:
        """ "shm", "broadcast", or None before `init` (and after a broadcast group failed)."""
        return self._backend

    def init(self, init_info: Mapping[str, Any], rank_offset: int) -> dict[str, Any]:
        """Set up the backend `init_info` names, leaving any earlier one; for the broadcast,
        join the trainer's group as rank `rank_offset + rank` (blocks until every rank of the
        group joins, within `init_info`'s timeout).

        Raises OperationError: "invalid" for a bad `init_info` or a group that cannot be
        joined, "unsupported" for a transport this device cannot use."""
        info = decode_init_info(init_info)
        self.close()
        if isinstance(info, BroadcastInit):
            if not 1 <= rank_offset < info.world_size:
                raise OperationError("invalid", f"rank_offset {rank_offset} outside the group")
            self._group = BroadcastGroup(info, rank_offset + self._rank, self._device)
            self._backend = "broadcast"
            return {"backend": "broadcast", "rank": self._group.rank}
        self._backend = "shm"
        return {"backend": "shm"}

    def update(self, update_info: Mapping[str, Any]) -> dict[str, Any]:
        """Load one bucket: what the loader answered.

        Raises OperationError: "conflict" before `init`, "invalid" for a bad `update_info`
        or bucket (nothing loaded), or a broadcast that failed (the group is then closed)."""
        if self._backend == "shm":
            shm = decode_update_info(update_info, "shm")
            assert isinstance(shm, ShmUpdate)
            with mapped_weights(shm) as weights:
                return self._apply(weights)
        group = self._group
        if group is None or group.closed:
            self.close()
            raise OperationError(
                "conflict", "no weight transfer engine: POST /init_weight_transfer_engine first"
            )
        try:
            update = decode_update_info(update_info, "broadcast")
        except OperationError as e:
            self.close()
            raise OperationError(
                "invalid", f"{e.message}; the broadcast group is closed, initialise it again"
            ) from None
        assert isinstance(update, BroadcastUpdate)
        try:
            if self._check is not None:
                try:
                    self._check(_specs(update))
                except OperationError:
                    group.drain(update)
                    raise
            return self._apply(group.receive(update))
        finally:
            if group.closed:
                self.close()

    def close(self) -> None:
        """Leave the backend (closing a broadcast group). Idempotent."""
        if self._group is not None:
            self._group.close()
        self._group = None
        self._backend = None


def _specs(update: BroadcastUpdate) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [
        (name, getattr(torch, dtype), tuple(shape))
        for name, dtype, shape in zip(update.names, update.dtype_names, update.shapes, strict=True)
    ]

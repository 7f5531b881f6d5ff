"""How the operator left an engine core, kept where its supervisor can find it: what a restarted
engine core must serve again beyond its flags.

The engine core writes its standing (`Standing`: the weights' version and the checkpoint of the
last `update_weights_from_disk`, whether a trainer's weights have replaced them since, the LoRA
adapters served with their paths and digests) to a file in its launcher's private directory
after every change, atomically. An engine core started again in its place reads it before READY
(`restore`): it loads those weights and adapters again, each adapter only if its files still
have the recorded digest. A trainer's pushed weights live only in the dead process: the restart
says so, serves the weights on disk, and gives them a new `weight_version`. Sleep, pause and the
prefix cache are not part of it: a restarted engine core is awake, unpaused and has an empty
cache.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import msgspec

from triode.wire.operations import OperationError

if TYPE_CHECKING:
    from .engine_core import EngineCore

log = logging.getLogger(__name__)

# what a standing file may hold: far above 64 adapters' names, paths and digests
MAX_STANDING_BYTES = 1 << 20


class StandingLoRA(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    path: str
    digest: str
    base_model_name: str | None = None


class Standing(msgspec.Struct, forbid_unknown_fields=True):
    weight_version: int = 0
    # the checkpoint of the last update_weights_from_disk (None: the served model's own)
    weights_path: str | None = None
    # a trainer's weights (update_weights) replaced those on disk since
    trainer_weights: bool = False
    loras: list[StandingLoRA] = []


def standing_of(core: EngineCore) -> Standing:
    operations = core.operations
    return Standing(
        weight_version=operations.version,
        weights_path=operations.weights_path,
        trainer_weights=not operations.from_source,
        loras=[
            StandingLoRA(e.name, e.path, e.digest, e.base_model_name)
            for e in sorted(core.loras.named.values(), key=lambda e: e.lora_id)
        ],
    )


class StandingFile:
    """One engine core's standing file (its launcher's directory, which only this user reads)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def read(self) -> Standing | None:
        """The standing a dead predecessor left, or None (a first start, or a file that is not
        one: the engine then starts as its flags say, and says so)."""
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_STANDING_BYTES + 1)
        except FileNotFoundError:
            return None
        if len(data) > MAX_STANDING_BYTES:
            log.error("the standing file %s is over %d bytes: ignored", self.path, len(data))
            return None
        try:
            return msgspec.json.decode(data, type=Standing)
        except msgspec.DecodeError as e:
            log.error("the standing file %s is not one (%s): ignored", self.path, e)
            return None

    def write(self, standing: Standing) -> None:
        """Replace the file at once (a reader sees the old standing or the new, never half)."""
        partial = f"{self.path}.partial"
        with open(partial, "wb") as f:
            f.write(msgspec.json.encode(standing))
        os.replace(partial, self.path)


async def restore(core: EngineCore, standing: Standing) -> None:
    """Serve again what `standing` records, before the engine core says READY: the weights of
    the last update from disk, then the adapters. One that no longer loads (its files gone or
    changed) is left out with an error line; the engine serves the rest."""
    operations = core.operations
    version = standing.weight_version
    if standing.weights_path is not None:
        try:
            operations.check_weight_path(standing.weights_path)
            await core.executor.call_workers(
                "update_weights_from_disk", model_path=standing.weights_path
            )
            operations.weights_path = standing.weights_path
        except (OperationError, RuntimeError) as e:
            log.error(
                "the weights of %s do not load again (%s): serving the model's own",
                standing.weights_path,
                getattr(e, "message", e),
            )
            version += 1
    if standing.trainer_weights:
        version += 1
        log.warning(
            "the weights a trainer pushed (weight_version %d) cannot be recovered: serving %s "
            "as weight_version %d",
            standing.weight_version,
            operations.weights_path or "the model's own weights",
            version,
        )
    operations.version = version
    core.scheduler.weight_version = version
    for lora in standing.loras:
        if lora.name in core.loras.named:  # a --lora-modules adapter, loaded already
            continue
        try:
            await core.loras.restore(lora.name, lora.path, lora.digest, lora.base_model_name)
        except (OperationError, RuntimeError) as e:
            log.error(
                "the LoRA adapter %r at %s does not load again: %s",
                lora.name,
                lora.path,
                getattr(e, "message", e),
            )
    log.info(
        "restored: weight_version %d, %d LoRA adapter(s)%s",
        version,
        len(core.loras.named),
        f", weights of {operations.weights_path}" if operations.weights_path else "",
    )

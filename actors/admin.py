"""The engine's administrative operations, on every engine core at once: sleep and wake, pause
and resume, the prefix cache, profiling, new weights (from a checkpoint on disk, or pushed by a
trainer process through shared memory or a torch.distributed broadcast), and LoRA adapters
loaded and unloaded.

Each is a UTILITY call (`triode.actors.core.operations` answers it in the engine core, and
`triode.actors.core.loras` the LoRA ones). A refusal raises `OperationError`, whose `kind` says
how (`invalid`, `conflict`, `unsupported`, `not_found`); with several engine cores (data
parallel), every live one takes the call and the first refusal is raised.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

CallAll = Callable[..., Awaitable[list[Any]]]


class EngineAdmin:
    """`Engine.admin`: the operations an administrator or a trainer calls."""

    def __init__(self, call_all: CallAll) -> None:
        self._call_all = call_all

    async def sleep(self, level: int = 1, tags: list[str] | None = None) -> dict[str, Any]:
        """Level 0 stops scheduling (requests wait, keeping their KV); level 1 also gives the
        KV cache's memory back (running requests are recomputed after the wake); level 2 also
        the weights'. `tags` (`kv_cache`, `weights`) name what to give back, in place of the
        level's. Returns when done, with the processes' resident memory."""
        return combined(await self._call_all("sleep", level, tags))

    async def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Take back what sleep gave (`tags`: only that); scheduling resumes once all is
        back. Weights given back are reloaded from their source unless new ones came."""
        return combined(await self._call_all("wake_up", tags))

    async def is_sleeping(self) -> bool:
        return any(await self._call_all("is_sleeping"))

    async def memory(self) -> dict[str, Any]:
        """The resident memory of each engine core's process and its ranks' (`rss_bytes`:
        their sum; `processes`: each)."""
        return combined(await self._call_all("memory"))

    async def pause(self, mode: str = "abort") -> dict[str, Any]:
        """`abort`: end in-flight requests now (finish reason `abort`); `wait`: let them finish,
        starting nothing new, and return when they have; `keep`: freeze them with their KV."""
        return combined(await self._call_all("pause", mode))

    async def resume(self) -> dict[str, Any]:
        return combined(await self._call_all("resume"))

    async def is_paused(self) -> bool:
        return any(await self._call_all("is_paused"))

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, also those of blocks running requests hold."""
        return all(await self._call_all("reset_prefix_cache"))

    async def start_profile(self) -> dict[str, Any]:
        return combined(await self._call_all("start_profile"))

    async def stop_profile(self) -> dict[str, Any]:
        """Returns once every rank's trace and the step timeline are written (`files`)."""
        return combined(await self._call_all("stop_profile"))

    async def update_weights_from_disk(self, model_path: str) -> dict[str, Any]:
        """New values for every weight from a checkpoint directory of the same architecture
        and shapes; in-flight requests are paused around the swap."""
        return combined(await self._call_all("update_weights_from_disk", model_path))

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> dict[str, Any]:
        """Prepare a transfer from a trainer: `{"backend": "shm"}`, or `{"backend":
        "broadcast", "master_address", "master_port", "world_size"}` (the trainer is rank 0 of
        that group; engine core e's rank r joins as 1 + e * ranks per engine + r)."""
        return combined(await self._call_all("init_weight_transfer_engine", init_info))

    async def start_weight_update(self) -> dict[str, Any]:
        return combined(await self._call_all("start_weight_update"))

    async def update_weights(self, update_info: dict[str, Any]) -> dict[str, Any]:
        return combined(await self._call_all("update_weights", update_info))

    async def finish_weight_update(self) -> dict[str, Any]:
        return combined(await self._call_all("finish_weight_update"))

    async def weight_version(self) -> int:
        return max(await self._call_all("weight_version"))

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, load_inplace: bool = False
    ) -> dict[str, Any]:
        """Serve the PEFT adapter at `lora_path` (under --allowed-lora-paths, or a
        --lora-modules path) as `lora_name`; with `load_inplace`, in place of the adapter of
        that name, whose running requests finish on it. Returns the adapter's `name`, `path`,
        `lora_id`, `digest`, `rank` and `base_model_name`. Refused: `unsupported` without
        --enable-lora; `invalid` for a bad name or path, a name already loaded (without
        `load_inplace`), or an adapter the model cannot take (the ranks' message); `conflict`
        when the ranks have no room for now."""
        return combined(await self._call_all("add_lora", lora_name, lora_path, load_inplace))

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Stop serving `lora_name` (`not_found` when it is not served); requests running
        with it finish on it. Returns what it was (as `load_lora_adapter`)."""
        return combined(await self._call_all("remove_lora", lora_name))


def combined(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine core's answer, or several's: the first's, with resident memory summed and
    each one's own under `engines`."""
    if len(results) == 1:
        return results[0]
    out = dict(results[0])
    if all("rss_bytes" in r for r in results):
        out["rss_bytes"] = sum(r["rss_bytes"] for r in results)
    out["engines"] = results
    return out

"""The scheduler's stats snapshot (`SchedulerStats`), which every step's outputs carry."""

from __future__ import annotations

from typing import TYPE_CHECKING

from triode.wire.messages import SchedulerStats

if TYPE_CHECKING:
    from .scheduler import Scheduler


def scheduler_stats(scheduler: Scheduler) -> SchedulerStats:
    """A snapshot; the prefix-cache counters (tokens) and preemptions are cumulative."""
    kv = scheduler.kv_cache
    connector = scheduler.connector
    return SchedulerStats(
        num_running_reqs=len(scheduler.running),
        num_waiting_reqs=len(scheduler.waiting),
        kv_cache_usage=kv.usage,
        num_free_blocks=kv.num_free_blocks,
        num_total_blocks=kv.num_blocks,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions,
        num_loading_reqs=len(scheduler.loading),
        num_held_reqs=len(scheduler.held),
        prompt_tokens_computed=scheduler.prompt_tokens_computed,
        prompt_tokens_transferred=scheduler.prompt_tokens_transferred,
        kv_load_failures=scheduler.kv_load_failures,
        kv_protocol_errors=scheduler.kv_protocol_errors,
        kv_params_refused=0 if connector is None else connector.seal_refusals,
    )

"""The blocks of a scheduler's KV transfers, between the KV connector's decisions and the
scheduler's queues.

The KV connector (`kv_connector.py`) decides which waiting requests load their prompt's KV from
another instance, and which finished ones keep their blocks for another instance to read; the
scheduler owns the queues. This keeps the blocks in between. A load's blocks are allocated
when it starts, and its request waits apart from the queues until every rank is through with
them: it then continues after its prompt, or computes the prompt itself if the load failed. A
hold keeps a finished request's prompt blocks until a decode instance has read them, the hold
expires, or the request is aborted. Pure Python, like the scheduler.
"""

from __future__ import annotations

from triode.wire.kv_transfer import KVConnectorOutput

from .kv_cache import KVCacheBlock, KVCacheManager
from .kv_connector import KVConnectorScheduler
from .request import Request, RequestStatus


class KVTransfers:
    """A scheduler's loads and holds, and the counts of what came of them."""

    def __init__(self, connector: KVConnectorScheduler, kv_cache: KVCacheManager) -> None:
        self.connector = connector
        self.kv_cache = kv_cache
        # Requests whose prompt KV is loading (aborted ones too, until every rank is through
        # with their blocks), and finished requests' blocks kept for another instance to read.
        self.loading: dict[str, Request] = {}
        self.held: dict[str, list[KVCacheBlock]] = {}
        self.prompt_tokens_transferred = 0  # prompt positions loaded from another instance
        self.load_failures = 0
        self.protocol_errors = 0

    def start_load(self, req: Request, hit_blocks: list[KVCacheBlock], num_external: int) -> bool:
        """Allocate the blocks of a prompt whose KV loads from another instance and park the
        request until it is there; False (nothing changed) when too few blocks are free. The
        scheduler takes a parked request off its queue."""
        if self.kv_cache.allocate_slots(req, num_external, hit_blocks, cache=False) is None:
            return False
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        num_hit = len(hit_blocks) * self.kv_cache.block_size
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        self.loading[req.request_id] = req
        self.connector.update_state_after_alloc(
            req, self.kv_cache.block_ids(req.request_id), num_external
        )
        return True

    def update(self, report: KVConnectorOutput) -> list[Request]:
        """Take the workers' report of a step: loads through or failed, holds read. Returns
        the requests whose load is through, in report order, to wait again for their turn."""
        ready = []
        for request_id in report.finished_recving:
            ready.append(self._loaded(request_id, ok=True))
        for request_id in report.failed_recving:
            ready.append(self._loaded(request_id, ok=False))
        for request_id in self.connector.sent(report.finished_sending):
            self.free_held(request_id)
        self.protocol_errors += report.protocol_errors
        return [req for req in ready if req is not None]

    def _loaded(self, request_id: str, ok: bool) -> Request | None:
        """Every rank is through with a request's load: it continues after the prompt's
        last token, or, when the load failed, computes its prompt like any other."""
        # only a load the connector planned, for params it verified, may fill the prefix cache
        ok = self.connector.load_done(request_id) and ok
        req = self.loading.pop(request_id, None)
        if req is None:
            return None
        if req.is_finished:  # aborted while loading
            self.kv_cache.free(req)
            return None
        if ok:
            self.kv_cache.cache_blocks(req, req.num_prompt_tokens)
            # counted apart from the local hit and the last token, recomputed here: the three
            # sources add up to the prompt
            loaded = req.num_prompt_tokens - 1 - max(0, req.num_cached_tokens)
            self.prompt_tokens_transferred += loaded
            # the last prompt token is computed here: its logits sample the first token
            req.num_computed_tokens = req.num_prompt_tokens - 1
        else:
            self.load_failures += 1
            self.kv_cache.free(req)
            req.num_computed_tokens = 0
            req.num_cached_tokens = -1
        req.status = RequestStatus.WAITING
        return req

    def finish(self, req: Request) -> None:
        """Free a finished request's blocks, or keep its prompt's for another instance to read
        when the connector holds them; what it hands on goes to `kv_transfer_params_out`."""
        block_ids = self.kv_cache.block_ids(req.request_id)
        delay_free, req.kv_transfer_params_out = self.connector.request_finished(req, block_ids)
        if delay_free:
            blocks = self.kv_cache.detach(req)
            keep = self.connector.prompt_blocks(req)  # a hold keeps the prompt's, no more
            self.kv_cache.release(blocks[keep:])
            self.held[req.request_id] = blocks[:keep]
        else:
            self.kv_cache.free(req)

    def drop_hold(self, request_id: str) -> None:
        """A finished request was aborted: the blocks it holds for another instance go too."""
        if self.connector.drop_hold(request_id):
            self.free_held(request_id)

    def expire_holds(self) -> None:
        """Free the blocks of holds past their deadline."""
        for request_id in self.connector.expired_holds():
            self.free_held(request_id)

    def free_held(self, request_id: str) -> None:
        blocks = self.held.pop(request_id, None)
        if blocks is not None:
            self.kv_cache.release(blocks)

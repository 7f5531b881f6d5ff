"""Paged KV cache accounting: which request owns which block, and the prefix cache.

The runner holds the K/V tensors; this module only decides which block ids a request writes.
Blocks are shared by reference count. A block that fills up gets a content hash chained over
the whole prefix, so a later request with the same prefix reuses it instead of recomputing.
Freed blocks keep their hash and stay revivable in an LRU free queue until they are reused.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from triode.wire.messages import EngineCoreRequest

from .kv_events import KVEventLog
from .request import Request

# The parent of a prompt's first block. Random per process, so that nobody outside can craft
# token sequences whose block hashes collide with another user's cached prefix.
NONE_HASH: bytes = os.urandom(32)


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """SHA-256 over the parent block's hash and this block's token ids.

    Chaining makes a hash name the whole prefix up to the end of the block, not just the block.
    Token ids pack as uint64, which holds any id msgpack can carry.
    """
    digest = hashlib.sha256(NONE_HASH if parent_hash is None else parent_hash)
    digest.update(array("Q", token_ids).tobytes())
    return digest.digest()


def salt_root(cache_salt: str) -> bytes:
    """What starts the block-hash chain of a request with a `cache_salt`, in place of
    `NONE_HASH`. The salt enters the first block's hash, so every block of the chain differs
    from an unsalted or differently salted request's (vLLM puts it in the first block's
    extra keys)."""
    digest = hashlib.sha256(NONE_HASH)
    digest.update(b"cache_salt\0")
    digest.update(cache_salt.encode("utf-8", "surrogatepass"))
    return digest.digest()


def lora_root(digest: str, parent: bytes | None = None) -> bytes:
    """What starts the block-hash chain of a request run with a LoRA adapter, in place of
    `NONE_HASH` (or of `parent`, a salted root): the adapter's content digest, not its name, so
    that two adapters, or one name reloaded with new weights, never share a cached block."""
    digest_ = hashlib.sha256(NONE_HASH if parent is None else parent)
    digest_.update(b"lora\0")
    digest_.update(digest.encode("ascii", "surrogateescape"))
    return digest_.digest()


def embeds_salt(dtype: str, embeds: np.ndarray, parent: bytes | None = None) -> bytes:
    """What starts the block-hash chain of a prompt given as embeddings, in place of
    `NONE_HASH` (or of `parent`, a salted root): its token ids are placeholders, so the chain
    must name the embeddings."""
    digest = hashlib.sha256(NONE_HASH if parent is None else parent)
    digest.update(f"prompt_embeds {dtype} {list(embeds.shape)}".encode())
    digest.update(np.ascontiguousarray(embeds).reshape(-1).view(np.uint8))
    return digest.digest()


def hash_root(
    request: EngineCoreRequest, prompt_embeds: np.ndarray | None, lora_digest: str | None
) -> bytes | None:
    """What the request's block-hash chain starts from (None: `NONE_HASH`): its cache salt,
    then the content digest of its LoRA adapter, then its prompt embeddings, each chained on
    the one before, so that blocks are shared only where all three agree."""
    root = None
    if request.cache_salt is not None:
        root = salt_root(request.cache_salt)
    if lora_digest is not None:
        root = lora_root(lora_digest, root)
    if prompt_embeds is not None:
        assert request.prompt_embeds is not None
        root = embeds_salt(request.prompt_embeds.dtype, prompt_embeds, root)
    return root


class KVCacheBlock:
    """One block of `block_size` token slots. `block_hash` is set only while the block is full
    and registered in the prefix cache."""

    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={cached})"


class BlockPool:
    """All blocks, the free queue and the hash -> block index.

    The free queue is ordered by eviction preference: blocks without a hash are worthless once
    freed and go to the front; hashed blocks go to the tail, so the head holds the least
    recently used cached block. An OrderedDict gives O(1) pop-front, append, prepend and the
    removal that a prefix hit on a free block needs.
    """

    def __init__(self, num_blocks: int, events: KVEventLog | None = None) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.events = events  # told of each eviction and clearing, when events are published
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks
        )
        self.cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free(self) -> int:
        """Blocks with no user, cached ones included: they can be evicted on demand."""
        return len(self.free_queue)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks from the head of the free queue; the caller checked there are `n`."""
        assert n <= len(self.free_queue), "allocate more blocks than are free"
        taken = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:  # evict: its content is about to be overwritten
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to prefix-hit blocks, reviving free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Register a block that just became full; whether it was. When another block already
        holds the same content (the lookup was skipped or capped), this one stays unhashed: no
        de-duplication, so block tables stay append-only, and the copy is the first to be
        reused once freed."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            return True
        return False

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the order given (the order they will be
        evicted in, among cached blocks)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is in use, because a running
        request's registered blocks would silently lose their sharing."""
        if self.num_free != len(self.blocks):
            return False
        self.forget()
        return True

    def forget(self) -> int:
        """Drop every hash, in use or not; how many there were."""
        forgotten = len(self.cached)
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()
        return forgotten


# a table's count of hashed blocks that no table reaches: it registers no more
_NEVER = 1 << 62


def _published(request: Request) -> bool:
    """Whether the request's blocks go out as KV events (`kv_events.py`): not when a salt
    keeps them to a tenant, nor when its token ids are placeholders for embeddings."""
    return request.cache_salt is None and request.prompt_embeds is None


class KVCacheManager:
    """Block tables of requests on top of a `BlockPool`, plus the prefix-cache policy."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        enable_prefix_caching: bool = True,
        events: KVEventLog | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, events)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # how many of a table's blocks are hashed
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def events(self) -> KVEventLog | None:
        """Where the cache's changes are recorded, when KV events are published."""
        return self.pool.events

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use; cached-but-free blocks count as free."""
        return 1.0 - self.pool.num_free / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """The longest run of cached blocks that starts the request's tokens.

        Capped so that at least the last token is recomputed: the runner needs its logits to
        sample. Skipped when the request wants prompt logprobs, which need every position's
        logits. Takes no references; `allocate_slots` does.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self._block_hashes(request, max_blocks)[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        *,
        cache: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones and the prefix hit
        `new_computed_blocks`; None (and nothing changed) when too few blocks are free.

        Blocks that the scheduled tokens fill are registered in the prefix cache right away,
        like vLLM: a request admitted later in the same step may hit them, which is sound
        because the runner writes a layer's K/V for the whole batch before attention reads it.
        Without `cache` they are not: their content comes from elsewhere (a KV transfer) and
        `cache_blocks` registers it once it is there.
        """
        blocks = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_total = num_computed + num_new_tokens
        num_needed = max(
            0, -(-num_total // self.block_size) - len(blocks) - len(new_computed_blocks)
        )
        # A hit on a free block takes it out of the free queue, so it costs a free block too.
        num_revived = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_needed + num_revived > self.pool.num_free:
            return None
        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_needed)
        blocks.extend(new_computed_blocks)
        blocks.extend(new_blocks)
        self.req_blocks[request.request_id] = blocks
        if self.enable_prefix_caching and cache:
            self._cache_full_blocks(request, blocks, num_total)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the full blocks of the request's first `num_tokens` tokens, whose K/V are
        now in place, in the prefix cache."""
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, self.req_blocks[request.request_id], num_tokens)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past those its first `num_tokens` tokens need: slots it
        reserved for proposals that were rejected. No prefix is registered there (a block is
        registered only once full of known tokens)."""
        blocks = self.req_blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        assert self._num_cached_blocks.get(request.request_id, 0) <= keep
        tail = blocks[keep:]
        del blocks[keep:]
        self.pool.free_blocks(reversed(tail))

    def free(self, request: Request) -> None:
        """Release the request's blocks."""
        self.release(self.detach(request))

    def detach(self, request: Request) -> list[KVCacheBlock]:
        """Take the request's block table away from it, blocks still held: for a finished
        request whose blocks outlive it (until `release`)."""
        self._num_cached_blocks.pop(request.request_id, None)
        return self.req_blocks.pop(request.request_id, [])

    def release(self, blocks: list[KVCacheBlock]) -> None:
        """Free a block table. Tail first, so that among the cached ones its later blocks are
        evicted before its prefix, which other requests are likelier to share."""
        self.pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def forget_prefixes(self) -> int:
        """Forget every cached prefix at once, also those of blocks in use, whose content no
        longer stands (the weights that computed it changed, or its memory went away); returns
        how many were forgotten. The requests holding blocks now register none of theirs: a
        block they fill is computed over the old content. One preempted or finished later
        registers again from a clean table."""
        forgotten = self.pool.forget()
        for request_id in self.req_blocks:
            self._num_cached_blocks[request_id] = _NEVER
        return forgotten

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_tokens: int
    ) -> None:
        # Slots reserved past the known tokens (proposals) must not hash a partial block.
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        registered = [self.pool.cache_block(blocks[i], hashes[i]) for i in range(start, num_full)]
        self._num_cached_blocks[request.request_id] = num_full
        if self.events is not None and any(registered) and _published(request):
            self._stored(request, hashes, start, registered)

    def _stored(
        self, request: Request, hashes: list[bytes], start: int, registered: list[bool]
    ) -> None:
        """Tell the event log of the request's blocks from `start` on that were registered
        just now (`registered`: a prefix hit, or a block whose content another one holds, was
        not), one event per unbroken run."""
        assert self.events is not None
        lora = None if request.lora is None else (request.lora.lora_id, request.lora.name)
        size, tokens = self.block_size, request.all_token_ids
        first = start
        for new, run in itertools.groupby(registered):
            last = first + len(list(run))
            if new:
                parent = hashes[first - 1] if first else None
                self.events.stored(
                    hashes[first:last], parent, tokens[first * size : last * size], lora
                )
            first = last

    def _block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's block hashes, extended to at least `num_blocks` full blocks."""
        hashes, tokens, size = request.block_hashes, request.all_token_ids, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else request.hash_root
            hashes.append(hash_block_tokens(parent, tokens[i * size : (i + 1) * size]))
        return hashes

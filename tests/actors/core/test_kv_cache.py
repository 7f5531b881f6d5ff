"""Block accounting and the prefix cache, without a scheduler."""

from __future__ import annotations

import numpy as np

from triode.actors.core.kv_cache import (
    BlockPool,
    KVCacheManager,
    embeds_salt,
    hash_block_tokens,
    salt_root,
)
from triode.actors.core.request import Request
from triode.wire import SamplingParams


def request(
    request_id: str, tokens: list[int], hash_root: bytes | None = None, **params: object
) -> Request:
    return Request(request_id, tokens, SamplingParams(**params), hash_root=hash_root)  # type: ignore[arg-type]


def free_order(pool: BlockPool) -> list[int]:
    return list(pool.free_queue)


def admit(kv: KVCacheManager, req: Request) -> int:
    """What the scheduler does for a waiting request: look up, allocate, count as computed."""
    hits = kv.get_computed_blocks(req)
    num_hit = len(hits) * kv.block_size
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return num_hit


def test_block_hashes_chain_over_the_prefix() -> None:
    first = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2]) == first
    assert hash_block_tokens(first, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(first, [3, 4]) != hash_block_tokens(
        hash_block_tokens(None, [9]), [3, 4]
    )
    assert len(first) == 32
    assert hash_block_tokens(None, [2**64 - 1]) != hash_block_tokens(None, [0])


def test_new_blocks_come_from_the_head_with_one_reference() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [0, 1]
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert free_order(pool) == [2, 3]


def test_freed_unhashed_blocks_are_reused_first_and_hashed_ones_last() -> None:
    pool = BlockPool(6)
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_block(a, b"h-a")
    pool.cache_block(b, b"h-b")
    pool.free_blocks(reversed([a, b, c, d]))  # how KVCacheManager.free releases a table
    # unhashed c, d in front (table order kept), then the untouched 4, 5, then the cached
    # blocks with the request's tail (b) evicted before its prefix (a)
    assert free_order(pool) == [2, 3, 4, 5, 1, 0]


def test_reusing_a_cached_block_evicts_its_hash() -> None:
    pool = BlockPool(1)
    [block] = pool.get_new_blocks(1)
    pool.cache_block(block, b"h")
    pool.free_blocks([block])
    assert pool.get_cached_block(b"h") is block and block.ref_cnt == 0
    [again] = pool.get_new_blocks(1)
    assert again is block and block.block_hash is None and pool.get_cached_block(b"h") is None


def test_touch_revives_a_free_block_and_shares_a_used_one() -> None:
    pool = BlockPool(3)
    [used, cached] = pool.get_new_blocks(2)
    pool.cache_block(cached, b"h")
    pool.free_blocks([cached])
    pool.touch([cached, used])
    assert (cached.ref_cnt, used.ref_cnt) == (1, 2)
    assert free_order(pool) == [2]
    pool.free_blocks([used, cached])
    assert used.ref_cnt == 1 and free_order(pool) == [2, 1]


def test_duplicate_content_stays_unhashed() -> None:
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, b"h")
    pool.cache_block(second, b"h")
    assert second.block_hash is None and pool.get_cached_block(b"h") is first


def test_lru_evicts_the_least_recently_freed_cached_prefix_first() -> None:
    kv = KVCacheManager(4, block_size=2)
    old, new = request("old", [1, 2, 3]), request("new", [7, 8, 9])
    admit(kv, old)
    admit(kv, new)
    kv.free(old)
    kv.free(new)
    # unhashed partial blocks first, then the cached ones in the order they were freed
    assert free_order(kv.pool) == [3, 1, 0, 2]
    # so taking three blocks evicts old's cached prefix and keeps new's
    other = request("other", [5, 5, 5, 5, 5])
    assert kv.allocate_slots(other, 5) is not None
    assert kv.pool.get_cached_block(old.block_hashes[0]) is None
    assert kv.pool.get_cached_block(new.block_hashes[0]) is not None
    assert kv.num_free_blocks == 1


def test_full_blocks_are_registered_as_scheduled_tokens_fill_them() -> None:
    kv = KVCacheManager(8, block_size=4)
    req = request("a", list(range(10)))
    assert len(kv.allocate_slots(req, 6) or []) == 2
    assert [b.block_hash is not None for b in kv.req_blocks["a"]] == [True, False]
    req.num_computed_tokens = 6
    assert len(kv.allocate_slots(req, 4) or []) == 1
    assert [b.block_hash is not None for b in kv.req_blocks["a"]] == [True, True, False]
    assert kv.pool.get_cached_block(req.block_hashes[1]) is kv.req_blocks["a"][1]


def test_prefix_hit_is_capped_to_recompute_the_last_token() -> None:
    kv = KVCacheManager(8, block_size=4)
    admit(kv, request("a", list(range(8))))
    assert len(kv.get_computed_blocks(request("same", list(range(8))))) == 1
    assert len(kv.get_computed_blocks(request("longer", list(range(9))))) == 2
    assert len(kv.get_computed_blocks(request("other", [0, 1, 2, 9, 4]))) == 0
    assert kv.prefix_cache_queries == 8 + 8 + 9 + 5
    assert kv.prefix_cache_hits == 4 + 8


def test_prefix_hit_shares_blocks_and_survives_the_first_owner() -> None:
    kv = KVCacheManager(4, block_size=2)
    a = request("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    b = request("b", [1, 2, 3, 4, 6])
    assert admit(kv, b) == 4
    assert kv.req_blocks["b"][:2] == kv.req_blocks["a"][:2]
    assert [blk.ref_cnt for blk in kv.req_blocks["b"]] == [2, 2, 1]
    kv.free(a)
    assert [blk.ref_cnt for blk in kv.req_blocks["b"]] == [1, 1, 1]
    assert kv.num_free_blocks == 1


def test_allocation_counts_cached_free_blocks_as_free_and_fails_without_side_effects() -> None:
    kv = KVCacheManager(3, block_size=2)
    a = request("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    kv.free(a)
    assert kv.usage == 0.0 and kv.num_free_blocks == 3
    big = request("big", list(range(10, 17)))
    before = free_order(kv.pool)
    assert kv.allocate_slots(big, 7) is None
    assert free_order(kv.pool) == before and "big" not in kv.req_blocks
    # a hit on two free cached blocks plus one new block takes all three
    c = request("c", [1, 2, 3, 4, 9])
    hits = kv.get_computed_blocks(c)
    assert len(hits) == 2
    assert kv.allocate_slots(c, 3, hits) is None  # needs 2 new + 2 revived > 3
    assert kv.allocate_slots(c, 1, hits) is not None
    assert kv.num_free_blocks == 0 and kv.usage == 1.0


def test_prompt_logprobs_skip_the_lookup() -> None:
    kv = KVCacheManager(4, block_size=2)
    admit(kv, request("a", [1, 2, 3, 4, 5]))
    assert kv.get_computed_blocks(request("b", [1, 2, 3, 4, 5], prompt_logprobs=0)) == []
    assert kv.prefix_cache_queries == 5


def test_disabled_prefix_caching_never_hashes_or_hits() -> None:
    kv = KVCacheManager(4, block_size=2, enable_prefix_caching=False)
    a = request("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    assert a.block_hashes == [] and not kv.pool.cached
    assert kv.get_computed_blocks(request("b", [1, 2, 3, 4, 5])) == []
    kv.free(a)
    assert free_order(kv.pool) == [0, 1, 2, 3]


def test_reset_prefix_cache_only_when_no_block_is_in_use() -> None:
    kv = KVCacheManager(4, block_size=2)
    a = request("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    assert kv.reset_prefix_cache() is False
    assert kv.pool.get_cached_block(a.block_hashes[0]) is not None
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert not kv.pool.cached and all(b.block_hash is None for b in kv.pool.blocks)
    assert kv.get_computed_blocks(request("b", [1, 2, 3, 4, 5])) == []


def test_different_salts_share_no_block_and_the_same_salt_shares_all() -> None:
    kv = KVCacheManager(16, block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    a = request("a", prompt, salt_root("tenant-a"))
    admit(kv, a)
    # the salt is in the first block's hash, so no block of the chain matches
    assert kv.get_computed_blocks(request("unsalted", prompt)) == []
    assert kv.get_computed_blocks(request("b", prompt, salt_root("tenant-b"))) == []
    again = request("a2", prompt, salt_root("tenant-a"))
    assert admit(kv, again) == 6
    assert kv.req_blocks["a2"][:3] == kv.req_blocks["a"][:3]
    plain = request("plain", prompt)
    admit(kv, plain)
    other = request("b2", prompt, salt_root("tenant-b"))
    assert admit(kv, other) == 0
    assert not set(kv.req_blocks["b2"]) & (set(kv.req_blocks["a"]) | set(kv.req_blocks["plain"]))
    assert not set(a.block_hashes) & set(plain.block_hashes)
    assert not set(a.block_hashes) & set(other.block_hashes)


def test_salt_roots_name_the_salt_and_combine_with_embeddings() -> None:
    assert salt_root("x") == salt_root("x") and len(salt_root("x")) == 32
    assert salt_root("x") != salt_root("y") != salt_root("")
    assert salt_root("\ud800") != salt_root("?")  # lone surrogates hash, never raise
    embeds = np.ones((3, 4), np.float32)
    plain = embeds_salt("float32", embeds)
    assert embeds_salt("float32", embeds, salt_root("x")) not in {plain, salt_root("x")}
    assert embeds_salt("float32", embeds, salt_root("x")) != embeds_salt(
        "float32", embeds, salt_root("y")
    )

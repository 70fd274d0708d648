"""Block pool, reference counts, LRU reuse and prefix caching of the KV cache manager."""

from __future__ import annotations

from armserve.engine.kv_cache_manager import KVCacheManager
from armserve.engine.request import Request
from armserve.sampling_params import SamplingParams


def req(rid: str, tokens: list[int], **params) -> Request:
    return Request(rid, tokens, SamplingParams(**params), max_tokens=16)


def test_allocate_and_free_returns_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = req("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    assert len(kv.get_block_ids("a")) == 3  # ceil(10 / 4)
    assert kv.num_free_blocks == 5
    kv.check_invariants()
    kv.free("a")
    assert kv.num_free_blocks == 8
    kv.check_invariants()


def test_allocation_fails_without_changing_anything():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = req("a", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert kv.num_free_blocks == 2 and "a" not in kv.req_blocks
    kv.check_invariants()


def test_growing_a_request_adds_blocks_only_at_boundaries():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = req("a", list(range(4)))
    assert kv.allocate_slots(r, 4)
    r.num_computed_tokens = 4
    r.append_output_token(100)
    assert kv.allocate_slots(r, 1)
    assert len(kv.get_block_ids("a")) == 2
    r.num_computed_tokens = 5
    r.append_output_token(101)
    assert kv.allocate_slots(r, 1)
    assert len(kv.get_block_ids("a")) == 2


def test_prefix_hit_shares_blocks_and_counts_hit_rate():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks
    a = req("a", prompt)
    assert kv.get_computed_blocks(a) == []
    assert kv.allocate_slots(a, 13)
    b = req("b", prompt + [7, 8])
    hit = kv.get_computed_blocks(b)
    assert hit == kv.get_block_ids("a")[:3]
    assert kv.allocate_slots(b, 15 - 12, hit)
    for blk in hit:
        assert kv.blocks[blk].ref_cnt == 2
    assert kv.prefix_hits == 12 and kv.prefix_queries == 13 + 15
    kv.check_invariants()


def test_hit_stops_one_token_short_of_the_whole_prompt():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(8))
    a = req("a", prompt)
    kv.allocate_slots(a, 8)
    b = req("b", prompt)
    # Both blocks are cached, but the last token must be recomputed for logits.
    assert len(kv.get_computed_blocks(b)) == 1


def test_freed_prefix_is_reused_until_evicted_least_recent_first():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", list(range(9)))
    kv.allocate_slots(a, 9)
    kv.free("a")
    # The cached blocks are free but still findable.
    b = req("b", list(range(9)))
    assert len(kv.get_computed_blocks(b)) == 2
    # Fill the pool with other tokens: the cached blocks are evicted, the hash map forgets them.
    c = req("c", list(range(50, 66)))
    assert kv.allocate_slots(c, 16)
    assert kv.cached == {h: blk for h, blk in kv.cached.items() if kv.blocks[blk].ref_cnt > 0}
    d = req("d", list(range(9)))
    assert kv.get_computed_blocks(d) == []
    kv.check_invariants()


def test_uncached_blocks_are_reused_before_cached_ones():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", list(range(6)))  # one full (cached) block + one partial
    kv.allocate_slots(a, 6)
    full, partial = kv.get_block_ids("a")
    kv.free("a")
    b = req("b", [99])
    kv.allocate_slots(b, 1)
    assert kv.get_block_ids("b") == [partial]
    assert kv.blocks[full].block_hash is not None


def test_hash_collision_is_a_miss():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = req("a", [1, 2, 3])
    kv.allocate_slots(a, 3)
    # Forge a collision: another request's first-block hash points at a's block.
    b = req("b", [5, 6, 7])
    kv._update_block_hashes(b, 2)
    kv.cached[b.block_hashes[0]] = kv.get_block_ids("a")[0]
    assert kv.get_computed_blocks(b) == []


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    b = req("b", [1, 2, 3, 4, 5], prompt_logprobs=1)
    assert kv.get_computed_blocks(b) == []


def test_disabled_caching_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=False)
    a = req("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    assert kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5])) == []
    assert kv.cached == {}

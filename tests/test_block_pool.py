"""The block pool and the KV cache manager: reference counts, LRU eviction, sharing."""

from engine.block_hash import extend_block_hashes
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def make_request(request_id: str, token_ids: list[int], block_size: int = 4, **kwargs) -> Request:
    request = Request(request_id, token_ids, SamplingParams(), **kwargs)
    extend_block_hashes(request, block_size)
    return request


def test_block_zero_is_never_allocated():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3]
    assert pool.num_free_blocks == 0


def test_freed_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(5)
    a, b, c, d = pool.allocate(4)
    for block, h in zip((a, b, c, d), (b"a", b"b", b"c", b"d")):
        pool.cache_block(block, h)
    pool.free([c])
    pool.free([a, d])
    pool.free([b])
    # Nothing is evicted until a block is needed; then the oldest free goes first.
    assert pool.lookup(b"c") is c
    first = pool.allocate(1)[0]
    assert first is c and pool.lookup(b"c") is None
    assert [blk.block_id for blk in pool.allocate(3)] == [a.block_id, d.block_id, b.block_id]


def test_cache_hit_on_a_free_block_revives_it():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"h")
    pool.free([block])
    assert pool.num_free_blocks == 2
    pool.touch([pool.lookup(b"h")])
    assert block.ref_count == 1 and pool.num_free_blocks == 1
    # The revived block is not handed out again while referenced.
    assert block not in pool.allocate(1)


def test_block_shared_by_two_requests_stays_until_both_free():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(10))
    first = make_request("a", prompt)
    assert kv.allocate_slots(first, len(prompt)) is not None
    second = make_request("b", prompt)
    hits = kv.find_cached_prefix(second)
    assert [b.block_id for b in hits] == kv.block_ids("a")[:2]
    assert kv.allocate_slots(second, len(prompt) - 8, hits) is not None
    shared = hits[0]
    assert shared.ref_count == 2
    kv.free(first)
    assert shared.ref_count == 1 and kv.pool.lookup(shared.block_hash) is shared
    kv.free(second)
    assert shared.ref_count == 0
    assert kv.pool.num_used_blocks == 0


def test_fully_cached_prompt_recomputes_its_last_block():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(8))
    assert kv.allocate_slots(make_request("a", prompt), 8) is not None
    hits = kv.find_cached_prefix(make_request("b", prompt))
    # Both blocks are cached, but the last token must run through the model.
    assert len(hits) == 1


def test_tail_of_a_chain_is_evicted_first():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    request = make_request("a", list(range(16)))
    assert kv.allocate_slots(request, 16) is not None
    head, *_, tail = kv.req_blocks["a"]
    kv.free(request)
    assert kv.pool.allocate(1)[0] is tail
    assert kv.pool.lookup(head.block_hash) is head


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots(make_request("a", list(range(8))), 8) is not None
    big = make_request("b", list(range(100, 112)))
    assert kv.allocate_slots(big, 12) is None
    assert "b" not in kv.req_blocks
    assert kv.pool.num_free_blocks == 1


def test_prefix_cache_disabled_never_hits():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False)
    prompt = list(range(12))
    assert kv.allocate_slots(make_request("a", prompt), 12) is not None
    assert kv.find_cached_prefix(make_request("b", prompt)) == []


def test_hit_statistics_count_each_admitted_request_once():
    from tests.test_scheduler import add, make_scheduler, run_step
    scheduler = make_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=64)
    add(scheduler, "a", 12, max_tokens=3)
    run_step(scheduler)
    # "b" shares a's first two blocks; "c" cannot fit until a finishes, so it is looked up
    # every step while it waits, yet counted once, when admitted.
    add(scheduler, "b", 12, max_tokens=3)
    add(scheduler, "c", 16, max_tokens=3, first_token=100)
    while scheduler.has_unfinished_requests:
        run_step(scheduler)
    stats = scheduler.kv.stats
    assert (stats.query_tokens, stats.hit_tokens) == (12 + 12 + 16, 8)

"""The hidden-state store (engine/hidden_state_store.py) beside the real KV cache manager: a
prefix hit yields the rows its first request wrote, a hit on blocks whose rows are not written
yet is refused (seed 002's race), and a reallocated block does not serve its old rows."""

import pytest
import torch

from engine.hidden_state_store import HiddenStateStore, HiddenStoreTooLarge
from engine.kv_cache_manager import KVCacheManager
from tests.test_block_pool import make_request

BLOCK = 4
WIDTH = 6


def slots_of(kv: KVCacheManager, request_id: str, start: int, end: int) -> torch.Tensor:
    """The KV slots of positions start..end-1, as the runner's slot mapping gives them."""
    blocks = kv.block_ids(request_id)
    return torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)])


def rows_for(request_tag: int, start: int, end: int) -> torch.Tensor:
    """A distinct row per (request, position)."""
    positions = torch.arange(start, end, dtype=torch.float32).unsqueeze(1)
    return positions * 10 + request_tag + torch.arange(WIDTH, dtype=torch.float32) / 100


def test_a_prefix_hit_yields_the_rows_the_first_request_wrote():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    store = HiddenStateStore(16, BLOCK, WIDTH)
    prompt = list(range(10))
    first = make_request("a", prompt)
    store.allocated([b.block_id for b in kv.allocate_slots(first, 10)])
    store.write(slots_of(kv, "a", 0, 10), rows_for(1, 0, 10))

    second = make_request("b", prompt + [99, 98])
    hits = kv.find_cached_prefix(second)
    assert len(hits) == 2  # two whole blocks; the third, partial, is recomputed
    cached = store.read([b.block_id for b in hits])
    assert torch.equal(cached, rows_for(1, 0, 8))
    # The partial block is the first request's alone, and not readable as a hit.
    assert store.read(kv.block_ids("a")[2:3]) is None


def test_a_block_published_before_its_rows_are_written_is_not_read():
    """Blocks are registered when scheduled; a request scheduled in the same step hits them
    before the forward that computes them has run."""
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    store = HiddenStateStore(16, BLOCK, WIDTH)
    prompt = list(range(9))
    first = make_request("a", prompt)
    store.allocated([b.block_id for b in kv.allocate_slots(first, 9)])
    hits = kv.find_cached_prefix(make_request("b", prompt))
    assert len(hits) == 2  # published already
    hit_ids = [b.block_id for b in hits]
    assert store.read(hit_ids) is None
    # A chunked prefill writes the first block only: still not all of the hit.
    store.write(slots_of(kv, "a", 0, 4), rows_for(1, 0, 4))
    assert store.is_whole(hit_ids[0]) and store.read(hit_ids) is None
    assert torch.equal(store.read(hit_ids[:1]), rows_for(1, 0, 4))
    store.write(slots_of(kv, "a", 4, 9), rows_for(1, 4, 9))
    assert torch.equal(store.read(hit_ids), rows_for(1, 0, 8))


def test_a_reallocated_block_does_not_serve_its_old_rows():
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK)  # block 0 reserved: two usable
    store = HiddenStateStore(3, BLOCK, WIDTH)
    first = make_request("a", list(range(8)))
    store.allocated([b.block_id for b in kv.allocate_slots(first, 8)])
    store.write(slots_of(kv, "a", 0, 8), rows_for(1, 0, 8))
    old_ids = kv.block_ids("a")
    kv.free(first)
    # Another prompt takes both blocks: their hashes are evicted and their rows are stale.
    second = make_request("b", list(range(100, 108)))
    new_ids = [b.block_id for b in kv.allocate_slots(second, 8)]
    store.allocated(new_ids)
    assert sorted(new_ids) == sorted(old_ids)
    assert store.read(new_ids) is None
    store.write(slots_of(kv, "b", 0, 8), rows_for(2, 0, 8))
    assert torch.equal(store.read(kv.block_ids("b")), rows_for(2, 0, 8))
    assert kv.find_cached_prefix(make_request("c", list(range(8)))) == []


def test_the_store_is_sized_from_the_model_and_bounded():
    assert HiddenStateStore.bytes_for(100, 16, 896, torch.bfloat16) == 100 * 16 * 896 * 2
    with pytest.raises(HiddenStoreTooLarge, match="over its limit of 1.0 MiB"):
        HiddenStateStore(100, 16, 896, torch.float32, max_bytes=1 << 20)
    store = HiddenStateStore(4, BLOCK, WIDTH, torch.bfloat16, max_bytes=1 << 20)
    with pytest.raises(ValueError, match="rows of shape"):
        store.write(torch.tensor([4, 5]), torch.zeros(3, WIDTH))
    assert store.read([]).shape == (0, WIDTH)

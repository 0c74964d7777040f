"""The data-parallel router's rule (frontend/replica_router.py), the cache events it is fed
(engine/block_pool.py), and the block hashes the front end computes for it, which must be the
decoder's own."""

import pytest

from engine.block_hash import extend_block_hashes, prompt_block_hashes
from engine.block_pool import BlockPool
from engine.request import MultiModalPlaceholder, Request
from engine.sampling_params import SamplingParams
from frontend.replica_router import NoReplica, ReplicaRouter


def chain(*names: str) -> list[bytes]:
    return [name.encode() for name in names]


def test_the_router_hashes_a_prompt_as_the_decoder_does():
    tokens = list(range(1, 60))
    placeholders = [MultiModalPlaceholder(offset=20, length=10, mm_hash="img-a", modality="image")]
    request = Request("r", tokens, SamplingParams(), mm_placeholders=placeholders, cache_salt="tenant-1")
    extend_block_hashes(request, 16)
    assert prompt_block_hashes(tokens, placeholders, "tenant-1", 16) == request.block_hashes
    assert len(request.block_hashes) == 3
    # Another image, another salt: other hashes from the block that holds it on.
    other = prompt_block_hashes(tokens, [MultiModalPlaceholder(offset=20, length=10, mm_hash="img-b",
                                                               modality="image")], "tenant-1", 16)
    assert other[0] == request.block_hashes[0] and other[1:] != request.block_hashes[1:]
    assert prompt_block_hashes(tokens, placeholders, "tenant-2", 16)[0] != request.block_hashes[0]


def test_the_pool_reports_what_enters_and_leaves_its_index():
    pool = BlockPool(4)
    blocks = pool.allocate(1)
    pool.cache_block(blocks[0], b"before")
    assert pool.take_events() is None  # not recording
    pool.record_events()
    blocks = pool.allocate(2)  # evicts nothing yet: block 1 is still held... the free ones are 2, 3
    pool.cache_block(blocks[0], b"a")
    pool.cache_block(blocks[1], b"b")
    pool.cache_block(blocks[1], b"b")  # already indexed: no second event
    # The first report says cleared: a successor's router forgets what its predecessor held.
    assert pool.take_events() == ([b"a", b"b"], [], True)
    assert pool.take_events() is None
    pool.free(blocks)
    held = pool.allocate(2)  # takes the two freed blocks back from the queue: their hashes leave
    assert pool.take_events() == ([], [b"a", b"b"], False)
    # Indexed and evicted between two reports: reported once, as gone.
    pool.free(held)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"c")
    pool.free([block])
    pool.allocate(2)
    assert pool.take_events() == ([], [b"c"], False)


def test_the_longest_cached_prefix_wins():
    router = ReplicaRouter(3)
    router.prefix_changed(0, chain("s1"), [])
    router.prefix_changed(1, chain("s1", "s2", "s3"), [])
    router.prefix_changed(2, chain("s1", "s2"), [])
    assert router.route(chain("s1", "s2", "s3", "s4")) == 1
    assert router.routed_for_prefix == [0, 1, 0]
    # A hash in the middle without its parent is no prefix.
    router.prefix_changed(0, chain("x3"), [])
    assert router.route(chain("s1", "x2", "x3")) in (0, 1, 2)
    assert router.route(chain("s1", "s2", "x3")) in (1, 2)


def test_an_overloaded_replica_gets_no_work_for_its_cache():
    router = ReplicaRouter(2, balance_ratio=1.5, balance_slack=2)
    router.prefix_changed(0, chain("s1", "s2"), [])
    assert router.route(chain("s1", "s2")) == 0
    router.load_reported(0, 10)
    router.load_reported(1, 3)  # bound: max(3 * 1.5, 3 + 2) = 5 < 10
    assert router.route(chain("s1", "s2")) == 1
    router.load_reported(0, 5)
    assert router.route(chain("s1", "s2")) == 0


def test_a_conversation_stays_on_its_replica_until_it_goes_down():
    router = ReplicaRouter(4)
    first = router.route(chain("c1"), conversation="sess-1")
    # Nothing published yet (events lag a step): the pin holds the next turn anyway.
    assert router.route(chain("other"), conversation="sess-1") == first
    router.replica_down(first)
    second = router.route(chain("c1"), conversation="sess-1")
    assert second != first
    router.replica_up(first)  # a new process with empty caches: the pin moved on
    assert router.route(chain("c1"), conversation="sess-1") == second


def test_cold_prompts_sharing_a_first_block_land_together_and_spread_otherwise():
    router = ReplicaRouter(8)
    placed = {router.route([f"system-{n}".encode(), b"user"]) for n in range(64)}
    assert len(placed) >= 6  # the placement spreads distinct prefixes
    again = ReplicaRouter(8)  # another front end: the same choice
    assert again.route([b"system-5", b"other user"]) == router.route([b"system-5", b"user 2"])


def test_a_lost_replica_is_forgotten_and_skipped():
    router = ReplicaRouter(2)
    router.prefix_changed(1, chain("s1", "s2"), [])
    router.items_changed(1, ["img"], [])
    router.replica_down(1)
    assert router.block_holders(b"s1") == [] and router.item_holders("img") == []
    assert router.route(chain("s1", "s2")) == 0
    router.replica_down(0)
    with pytest.raises(NoReplica):
        router.route(chain("s1"))


def test_evictions_and_a_cleared_index_update_the_view():
    router = ReplicaRouter(2)
    router.prefix_changed(0, chain("a", "b"), [])
    router.prefix_changed(1, chain("a"), [])
    router.prefix_changed(0, [], chain("b"))
    assert router.block_holders(b"b") == [] and router.block_holders(b"a") == [0, 1]
    router.prefix_changed(0, chain("c"), [], cleared=True)
    assert router.block_holders(b"a") == [1] and router.block_holders(b"c") == [0]
    assert router.blocks_indexed(0) == 1


def test_ties_go_to_the_replica_whose_encoder_holds_the_items():
    router = ReplicaRouter(2)
    router.prefix_changed(0, chain("s1"), [])
    router.prefix_changed(1, chain("s1"), [])
    router.items_changed(1, ["img-1"], [])
    assert router.route(chain("s1", "s2"), ["img-1"]) == 1


def test_the_other_policies():
    router = ReplicaRouter(3, "round-robin")
    assert [router.route(()) for _ in range(4)] == [0, 1, 2, 0]
    router.replica_down(1)
    assert [router.route(()) for _ in range(2)] == [2, 0]
    least = ReplicaRouter(3, "least-loaded")
    least.load_reported(0, 4)
    least.load_reported(2, 1)
    assert least.route(chain("x")) == 1
    assert least.route(chain("x")) == 1  # in flight 1 = replica 2's 1: the first of the lightest
    with pytest.raises(ValueError):
        ReplicaRouter(2, "random")


def test_finished_requests_leave_the_load():
    router = ReplicaRouter(2, "least-loaded")
    first = router.route(())
    assert router.in_flight[first] == 1
    router.finished(first)
    router.finished(first)  # idempotent at zero
    assert router.in_flight == [0, 0]


def test_the_router_reads_no_hash_past_the_first_block_nobody_holds():
    router = ReplicaRouter(2)
    router.prefix_changed(1, chain("s1", "s2"), [])
    read = []

    def hashes():
        for name in ("s1", "s2", "s3", "s4", "s5"):
            read.append(name)
            yield name.encode()

    assert router.route(hashes()) == 1
    assert read == ["s1", "s2", "s3"]


@pytest.mark.parametrize("cores", [1, 2, 4, 16])
def test_local_replicas_split_the_cores_and_publish_their_caches(monkeypatch, cores):
    from engine.config import EngineConfig
    from frontend import replica_set

    monkeypatch.setattr(replica_set, "usable_cores", lambda: cores)
    for replicas in (2, 4):
        config = replica_set.replica_config(EngineConfig(model="unused"), replicas, on_one_machine=True)
        assert config.publish_cache_events
        assert config.decoder_threads == max(1, cores // replicas)
    # Past one machine a replica's CPU bundle is its decoder's threads: one unless told.
    assert replica_set.replica_config(EngineConfig(model="unused"), 2, on_one_machine=False).decoder_threads == 1
    told = EngineConfig(model="unused", decoder_threads=3)
    assert replica_set.replica_config(told, 2, on_one_machine=True).decoder_threads == 3

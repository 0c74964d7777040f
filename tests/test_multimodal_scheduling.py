"""Scheduling around multimodal items, with a stand-in encoder and runner (no model).

The cases are the ones that broke other engines: tokens of an item scheduled before its
embeddings (vLLM #38551), items encoded although a prefix hit covers them, the seed-003
pair of identical requests whose shared last block holds part of an image, embeddings kept
forever (vLLM #15294), and requests that spin forever waiting for an encoder (vLLM #26223).
"""

import numpy as np
import pytest

from engine.config import EngineConfig, encoder_budget, global_encoder_cache_size
from engine.kv_cache_manager import KVCacheManager
from engine.request import MultiModalPlaceholder, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import ModelRunnerOutput

IMAGE_TOKEN = 999


def make_scheduler(num_blocks=64, block_size=4, budget=40, **config) -> Scheduler:
    cfg = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, **config)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, cfg.enable_prefix_caching), 512, budget)


def add(scheduler, request_id, text_before, image_len, text_after, image="img-a", max_tokens=2, **params):
    tokens = list(range(1, text_before + 1)) + [IMAGE_TOKEN] * image_len + list(range(100, 100 + text_after))
    placeholders = [MultiModalPlaceholder(text_before, image_len, image)] if image_len else []
    request = Request(request_id, tokens, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                         **params), mm_placeholders=placeholders)
    scheduler.add_request(request)
    return request


def embeddings_for(scheduler, mm_hash):
    """Stand-in embeddings of the right length (one value per row)."""
    return np.zeros((scheduler.embeddings.entries[mm_hash].size, 1))


class Runner:
    """Checks each step's item rows against what it holds, like the real runner."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.held: dict[str, object] = {}
        self.encoder_asks: list[str] = []

    def step(self, deliver=True):
        wanted = self.scheduler.plan_encoder_inputs()
        self.encoder_asks += wanted
        if deliver:
            for mm_hash in wanted:
                self.scheduler.on_embeddings(mm_hash, embeddings_for(self.scheduler, mm_hash))
        sched = self.scheduler.schedule()
        self.held.update(sched.new_embeddings)
        for rid, count in sched.num_scheduled_tokens.items():
            request = self.scheduler.requests[rid]
            end = request.num_computed_tokens
            start = end - count
            for item in request.mm_placeholders:
                if item.offset < end and item.end > start:
                    assert item.mm_hash in self.held, f"{rid} scheduled tokens of {item.mm_hash} before its embeddings"
        sampled = {rid: 7 for rid in sched.num_scheduled_tokens if self.scheduler.requests[rid].num_output_placeholders}
        outputs = self.scheduler.update_from_output(sched, ModelRunnerOutput(sampled_token_ids=sampled))
        for mm_hash in sched.free_embeddings:
            del self.held[mm_hash]
        return sched, outputs


def test_text_before_an_image_prefills_while_the_image_is_encoded():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    add(scheduler, "r", 10, 8, 3)
    runner = Runner(scheduler)
    sched, _ = runner.step(deliver=False)  # the encoder is busy: nothing arrives yet
    assert runner.encoder_asks == ["img-a"]
    assert sched.num_scheduled_tokens == {"r": 10}
    sched, _ = runner.step(deliver=False)
    assert sched.num_scheduled_tokens == {}  # never a token of the image before its embeddings
    scheduler.on_embeddings("img-a", embeddings_for(scheduler, "img-a"))
    sched, _ = runner.step()
    assert sched.num_scheduled_tokens == {"r": 11}
    assert runner.encoder_asks == ["img-a"]


def test_a_chunk_that_ends_inside_an_image_continues_from_there():
    scheduler = make_scheduler(max_num_batched_tokens=6)
    request = add(scheduler, "r", 4, 8, 2, max_tokens=1)
    runner = Runner(scheduler)
    chunks = []
    while scheduler.has_unfinished_requests:
        sched, _ = runner.step()
        chunks.append(sched.num_scheduled_tokens.get("r", 0))
    assert chunks == [6, 6, 2]
    assert request.status is RequestStatus.FINISHED_LENGTH


def test_embeddings_are_dropped_once_their_tokens_are_computed():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    add(scheduler, "r", 2, 8, 2, max_tokens=5)
    runner = Runner(scheduler)
    sched, _ = runner.step()
    assert sched.num_scheduled_tokens == {"r": 12}
    assert sched.free_embeddings == ["img-a"]  # dropped after this step ran
    assert runner.held == {} and scheduler.embeddings.used == 0


def test_an_image_covered_by_a_prefix_hit_is_never_encoded_again():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    add(scheduler, "first", 4, 8, 9)
    runner = Runner(scheduler)
    while scheduler.has_unfinished_requests:
        runner.step()
    assert runner.encoder_asks == ["img-a"]
    second = add(scheduler, "second", 4, 8, 9)
    while scheduler.has_unfinished_requests:
        runner.step()
    assert runner.encoder_asks == ["img-a"]  # the prefix cache covered the image
    assert second.num_cached_tokens == 20


def test_same_text_different_image_never_shares_kv_past_the_image():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    add(scheduler, "a", 8, 8, 9, image="img-a")
    runner = Runner(scheduler)
    while scheduler.has_unfinished_requests:
        runner.step()
    other = add(scheduler, "b", 8, 8, 9, image="img-b")
    while scheduler.has_unfinished_requests:
        runner.step()
    assert other.num_cached_tokens == 8  # the text before the image, not one block more
    assert runner.encoder_asks == ["img-a", "img-b"]


def test_two_identical_requests_in_one_step_sharing_an_image_in_the_recomputed_last_block():
    # seed 003: the prompt is a multiple of the block size, the image ends in the last block
    # and the budget splits the image. The second request's prefix hit stops one block short
    # and recomputes tokens of the image while the first one still holds it.
    scheduler = make_scheduler(max_num_batched_tokens=10, block_size=4, budget=encoder_budget(
        EngineConfig(max_num_batched_tokens=10), 12))
    first = add(scheduler, "r0", 2, 12, 2, max_tokens=3)
    runner = Runner(scheduler)
    runner.step()
    second = add(scheduler, "r1", 2, 12, 2, max_tokens=3)
    while scheduler.has_unfinished_requests:
        runner.step()
    assert first.output_token_ids == second.output_token_ids == [7, 7, 7]
    assert runner.encoder_asks.count("img-a") <= 2
    assert scheduler.embeddings.used == 0 and runner.held == {}


def test_an_item_larger_than_the_budget_is_refused_up_front():
    scheduler = make_scheduler(budget=16)
    with pytest.raises(ValueError, match="larger than the encoder cache budget"):
        add(scheduler, "r", 2, 17, 2)
    assert not scheduler.has_unfinished_requests


def test_an_image_the_encoder_never_delivers_fails_its_request_after_the_timeout(monkeypatch):
    scheduler = make_scheduler(encoder_timeout_s=5.0)
    request = add(scheduler, "r", 4, 8, 2)
    other = add(scheduler, "text", 6, 0, 0, image=None)
    runner = Runner(scheduler)
    runner.step(deliver=False)
    clock = __import__("time").monotonic() + 6.0
    monkeypatch.setattr("engine.embedding_tracker.time.monotonic", lambda: clock)
    _, outputs = runner.step(deliver=False)
    errors = [o for o in outputs if o.finish_reason == "error"]
    assert [o.request_id for o in errors] == ["r"] and "encoder_timeout_s" in errors[0].error
    assert request.status is RequestStatus.FINISHED_ERROR
    while scheduler.has_unfinished_requests:
        runner.step()
    assert other.status is RequestStatus.FINISHED_LENGTH
    assert scheduler.embeddings.used == 0


def test_a_lost_encoder_fails_what_was_asked_of_it_at_once_and_its_successor_is_asked_afresh():
    scheduler = make_scheduler(encoder_timeout_s=60.0)
    add(scheduler, "asked", 4, 8, 2, image="img-x")
    text = add(scheduler, "text", 6, 0, 0, image=None)
    runner = Runner(scheduler)
    runner.step(deliver=False)
    assert runner.encoder_asks == ["img-x"]
    scheduler.fail_items_in_flight("the encoder process crashed")
    _, outputs = runner.step(deliver=False)
    errors = [o for o in outputs if o.finish_reason == "error"]
    assert [o.request_id for o in errors] == ["asked"] and "crashed" in errors[0].error
    # The same image in a later request is asked of the new encoder, not joined to the lost ask.
    later = add(scheduler, "later", 4, 8, 2, image="img-x")
    while scheduler.has_unfinished_requests:
        runner.step()
    assert runner.encoder_asks == ["img-x", "img-x"]
    assert later.status is RequestStatus.FINISHED_LENGTH and text.status is RequestStatus.FINISHED_LENGTH
    assert scheduler.embeddings.used == 0


def test_a_failed_encoding_fails_only_the_requests_that_need_it():
    scheduler = make_scheduler()
    add(scheduler, "bad", 4, 8, 2, image="img-bad")
    good = add(scheduler, "good", 4, 8, 2, image="img-good")
    runner = Runner(scheduler)
    wanted = scheduler.plan_encoder_inputs()
    assert wanted == ["img-bad", "img-good"]
    scheduler.on_embeddings("img-bad", error="cannot decode")
    scheduler.on_embeddings("img-good", embeddings_for(scheduler, "img-good"))
    while scheduler.has_unfinished_requests:
        runner.step()
    assert good.status is RequestStatus.FINISHED_LENGTH
    assert scheduler.embeddings.used == 0


def test_a_waiting_image_request_steps_aside_for_text_behind_it():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    add(scheduler, "image-first", 0, 8, 2)
    text = add(scheduler, "text", 5, 0, 0, image=None)
    runner = Runner(scheduler)
    sched, _ = runner.step(deliver=False)
    assert sched.num_scheduled_tokens == {"text": 5}
    assert text.status is RequestStatus.RUNNING
    assert scheduler.waiting[0].request_id == "image-first"


def test_preempted_request_asks_for_its_image_again():
    scheduler = make_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=64)
    a = add(scheduler, "a", 2, 8, 2, max_tokens=12, image="img-a")
    b = add(scheduler, "b", 2, 8, 2, max_tokens=12, image="img-b")
    runner = Runner(scheduler)
    while scheduler.has_unfinished_requests:
        runner.step()
    assert scheduler.num_preemptions > 0
    assert a.output_token_ids == b.output_token_ids == [7] * 12
    assert runner.encoder_asks.count("img-b") >= 2  # asked again after its preemption
    assert scheduler.embeddings.used == 0 and runner.held == {}


def test_budget_is_shared_first_come_first_served_and_released():
    scheduler = make_scheduler(budget=10, max_num_batched_tokens=64)
    requests = [add(scheduler, f"r{i}", 2, 8, 2, image=f"img-{i}") for i in range(3)]
    runner = Runner(scheduler)
    assert scheduler.plan_encoder_inputs() == ["img-0"]  # only one 8-embedding item fits in 10
    for mm_hash in ["img-0"]:
        scheduler.on_embeddings(mm_hash, embeddings_for(scheduler, mm_hash))
    while scheduler.has_unfinished_requests:
        runner.step()
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
    assert scheduler.embeddings.used == 0


def add_many(scheduler, request_id, images, gap=3, max_tokens=2):
    """A request with several 8-embedding images, `gap` text tokens before each."""
    tokens, placeholders = [], []
    for image in images:
        tokens += list(range(1, gap + 1))
        placeholders.append(MultiModalPlaceholder(len(tokens), 8, image))
        tokens += [IMAGE_TOKEN] * 8
    request = Request(request_id, tokens + [5], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                      mm_placeholders=placeholders)
    scheduler.add_request(request)
    return request


@pytest.mark.parametrize("text_words", [1, 4, 9, 14, 22])
def test_a_request_never_holds_later_images_without_its_next_one(text_words):
    # A request with three images and a budget of two: it must not end up running while
    # holding its second and third images but not its first (it would wait forever).
    scheduler = make_scheduler(budget=16, max_num_batched_tokens=16)
    text = add(scheduler, "text", text_words, 0, 0, image=None, max_tokens=3)
    images = add_many(scheduler, "images", ["i1", "i2", "i3"])
    runner = Runner(scheduler)
    for _ in range(100):
        if not scheduler.has_unfinished_requests:
            break
        runner.step()
    assert text.status is RequestStatus.FINISHED_LENGTH
    assert images.status is RequestStatus.FINISHED_LENGTH, (images.status, images.num_computed_tokens)
    assert runner.encoder_asks.count("i1") == 1
    assert scheduler.embeddings.used == 0 and runner.held == {}


def test_claims_are_a_prefix_of_the_items_still_needed():
    scheduler = make_scheduler(budget=16)
    request = add_many(scheduler, "r", ["i1", "i2", "i3"])
    assert scheduler.plan_encoder_inputs() == ["i1", "i2"]
    assert scheduler.embeddings.users_of("i3") == set()


def test_embeddings_of_the_wrong_length_fail_the_request_not_the_engine():
    scheduler = make_scheduler()
    request = add(scheduler, "r", 4, 8, 2)
    other = add(scheduler, "text", 6, 0, 0, image=None)
    assert scheduler.plan_encoder_inputs() == ["img-a"]
    scheduler.on_embeddings("img-a", np.zeros((7, 1)))
    runner = Runner(scheduler)
    while scheduler.has_unfinished_requests:
        runner.step()
    assert request.status is RequestStatus.FINISHED_ERROR and "another length" in request.error
    assert other.status is RequestStatus.FINISHED_LENGTH


def test_global_encoder_cache_is_sized_by_memory_apart_from_the_decoder_budget():
    """The decoder's budget holds a step's worth plus one item (seed 003); the global cache
    must hold many distinct images (benchmark (a): 30 images, 30 encoder runs), so it is sized
    by memory, never below the decoder's budget, and is 0 when turned off."""
    config = EngineConfig(model="unused", max_num_batched_tokens=512)
    decoder = encoder_budget(config, 192)
    assert decoder == 512 + 192
    # 1 GiB of 768-wide float32 embeddings.
    assert global_encoder_cache_size(config, 192, 768 * 4) == (1 << 30) // (768 * 4)
    tiny = EngineConfig(model="unused", max_num_batched_tokens=512, encoder_cache_gib=1e-6)
    assert global_encoder_cache_size(tiny, 192, 768 * 4) == decoder
    off = EngineConfig(model="unused", enable_encoder_cache=False)
    assert global_encoder_cache_size(off, 192, 768 * 4) == 0
    with pytest.raises(ValueError, match="encoder_cache_gib"):
        EngineConfig(model="unused", encoder_cache_gib=-1)

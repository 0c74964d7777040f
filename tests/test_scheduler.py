"""Scheduler behaviour, driven with a stand-in runner that samples token 7 everywhere."""

import pytest

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import ModelRunnerOutput


def make_scheduler(num_blocks=64, block_size=4, max_model_len=256, **config) -> Scheduler:
    cfg = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, **config)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, cfg.enable_prefix_caching), max_model_len)


def add(scheduler, request_id, prompt_len, max_tokens=4, first_token=0):
    request = Request(request_id, list(range(first_token, first_token + prompt_len)),
                      SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    scheduler.add_request(request)
    return request


def run_step(scheduler):
    sched = scheduler.schedule()
    # A request samples when its chunk reached its last known token: it holds a placeholder.
    sampled = {rid: 7 for rid in sched.num_scheduled_tokens if scheduler.requests[rid].num_output_placeholders}
    return sched, scheduler.update_from_output(sched, ModelRunnerOutput(sampled_token_ids=sampled))


def test_decodes_are_scheduled_before_new_prefill_chunks():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    add(scheduler, "old", 6)
    run_step(scheduler)
    add(scheduler, "new", 30)
    sched, _ = run_step(scheduler)
    assert list(sched.num_scheduled_tokens) == ["old", "new"]
    assert sched.num_scheduled_tokens == {"old": 1, "new": 9}


def test_long_prompt_is_prefilled_in_chunks_within_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    request = add(scheduler, "long", 50, max_tokens=1)
    chunks = []
    while scheduler.has_unfinished_requests:
        sched, outputs = run_step(scheduler)
        chunks.append(sched.num_scheduled_tokens.get("long", 0))
    assert chunks == [16, 16, 16, 2]
    assert request.output_token_ids == [7] and request.status == RequestStatus.FINISHED_LENGTH


def test_max_num_seqs_caps_the_running_batch():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(4):
        add(scheduler, f"r{i}", 3)
    sched, _ = run_step(scheduler)
    assert set(sched.num_scheduled_tokens) == {"r0", "r1"}
    assert len(scheduler.waiting) == 2


def test_newest_request_is_preempted_and_the_oldest_keeps_running():
    # 7 usable blocks of 4 tokens; three requests of 8-token prompts take 6.
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=64)
    old, mid, new = (add(scheduler, name, 8, max_tokens=12, first_token=10 * i)
                     for i, name in enumerate(["old", "mid", "new"]))
    preempted_order = []
    while scheduler.has_unfinished_requests:
        sched, _ = run_step(scheduler)
        preempted_order += [r for r in sched.finished_request_ids if r in scheduler.requests]
        assert "old" in sched.num_scheduled_tokens or old.status.finished
    assert preempted_order and preempted_order[0] == "new"
    assert all(r.output_token_ids == [7] * 12 for r in (old, mid, new))
    assert scheduler.kv.pool.num_used_blocks == 0


def test_request_outgrowing_the_whole_pool_fails_with_a_clear_error():
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    request = add(scheduler, "greedy", 6, max_tokens=50)
    errors = []
    for _ in range(30):
        _, outputs = run_step(scheduler)
        errors += [o for o in outputs if o.finish_reason == "error"]
        if not scheduler.has_unfinished_requests:
            break
    assert not scheduler.has_unfinished_requests
    assert len(errors) == 1 and "KV blocks" in errors[0].error
    assert request.status == RequestStatus.FINISHED_ERROR
    assert scheduler.kv.pool.num_used_blocks == 0


def test_stall_guard_fails_a_request_that_cannot_be_scheduled():
    scheduler = make_scheduler(num_blocks=8, max_stalled_steps=3)
    blocker = add(scheduler, "blocker", 4)
    stuck = add(scheduler, "stuck", 4)
    # Simulate a request that never gets scheduled: the blocker holds every block forever.
    scheduler.kv.pool.allocate(scheduler.kv.pool.num_free_blocks)
    scheduler.waiting.clear()
    scheduler.waiting.append(stuck)
    outputs = []
    for _ in range(3):
        outputs += run_step(scheduler)[1]
    assert [o.request_id for o in outputs if o.finish_reason == "error"] == ["stuck"]
    assert "no progress" in stuck.error
    assert blocker.request_id in scheduler.requests


def test_prompt_as_long_as_the_context_is_rejected_up_front():
    scheduler = make_scheduler(max_model_len=32)
    with pytest.raises(ValueError, match="context"):
        add(scheduler, "too-long", 32)
    assert not scheduler.has_unfinished_requests


def test_generation_stops_at_the_context_length():
    scheduler = make_scheduler(max_model_len=12)
    request = add(scheduler, "r", 8, max_tokens=100)
    while scheduler.has_unfinished_requests:
        run_step(scheduler)
    assert request.num_tokens == 12 and request.status == RequestStatus.FINISHED_LENGTH


def test_abort_frees_blocks_and_tells_the_runner():
    scheduler = make_scheduler()
    add(scheduler, "a", 10, max_tokens=50)
    run_step(scheduler)
    assert scheduler.kv.pool.num_used_blocks > 0
    scheduler.abort_requests(["a"])
    assert scheduler.kv.pool.num_used_blocks == 0
    sched, _ = run_step(scheduler)
    assert sched.finished_request_ids == {"a"}


def test_only_new_block_ids_are_sent_to_the_runner():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    add(scheduler, "r", 10, max_tokens=8)
    sent = []
    while scheduler.has_unfinished_requests:
        sched, _ = run_step(scheduler)
        sent += [b for n in sched.new_requests for b in n.block_ids]
        sent += [b for ids in sched.cached_requests.new_block_ids for b in ids]
    # 18 tokens need 5 blocks of 4, each sent exactly once.
    assert len(sent) == len(set(sent)) == 5

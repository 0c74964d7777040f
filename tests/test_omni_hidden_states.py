"""The hidden-state store wired into the decoder (seed 002): an omni thinker's per-position rows
for its talker are written every step through the step's slot mapping, and read back from the
store, also for positions a prefix hit covered.

The rows must be what transformers' Qwen2.5-Omni `generate` hands its talker: for each prompt
position and each generated token but the last, the thinker's last hidden state plus its
layer-0 embedding (zero where an image or audio item stood). Each edge case of the seed is a
test: a hit that ends inside an item, identical requests in one step, eviction and reuse.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from tests.omni_models import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, SAMPLE_RATE, save_tiny_omni
from tests.omni_reference import hf_omni_inputs, load_reference_omni
from tests.test_omni_parity import as_prompt, clip, picture

MAX_TOKENS = 5


@pytest.fixture(scope="module")
def tiny_omni(tmp_path_factory):
    return save_tiny_omni("qwen2_5_omni", tmp_path_factory.mktemp("omni-rows") / "qwen2_5_omni")


def reference_rows(path, text: str, images: list, clips: list) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens, and the talker's rows for the prompt and every generated
    token but the last, as Qwen2_5OmniForConditionalGeneration.generate builds them."""
    inputs = hf_omni_inputs(path, text, images, clips)
    model = load_reference_omni(path)
    with torch.no_grad():
        out = model.thinker.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                     output_hidden_states=True, return_dict_in_generate=True)
    config = model.config.thinker_config
    items = torch.isin(inputs["input_ids"][0], torch.tensor([config.image_token_id, config.audio_token_id]))
    steps = out.hidden_states
    prompt = steps[0][-1][0] + steps[0][0][0].masked_fill(items.unsqueeze(-1), 0)
    replies = [step[-1][0] + step[0][0] for step in steps[1:]]
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), torch.cat([prompt, *replies])


def run_and_read_rows(llm: LLM, prompts: list) -> list[tuple[list[int], torch.Tensor]]:
    """Runs the prompts together; each request's tokens and the rows the runner's store gives
    for its prompt and all but its last token, read right after the step that finishes it."""
    engine = llm.engine
    runner = engine.core.executor.runner
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                length = len(out.prompt_token_ids) + len(out.token_ids) - 1
                done[out.request_id] = (out.token_ids, runner.talker_rows(out.request_id, 0, length))
    return [done[i] for i in ids]


CASES = [
    ("Describe the river stone.", [], []),
    (f"See {IMAGE_PLACEHOLDER} and hear {AUDIO_PLACEHOLDER} then answer", [picture(3)], [clip(4, 1.5)]),
]


@pytest.mark.parametrize("block_size,budget", [(16, 2048), (4, 8)])
def test_stored_rows_equal_what_transformers_hands_the_talker(tiny_omni, block_size, budget):
    llm = LLM(str(tiny_omni), quantization="none", omni_speech=True, block_size=block_size,
              max_num_batched_tokens=budget)
    for (text, images, clips), (tokens, rows) in zip(CASES, run_and_read_rows(
            llm, [as_prompt(*case) for case in CASES])):
        expected_tokens, expected_rows = reference_rows(tiny_omni, text, images, clips)
        assert tokens == expected_tokens
        torch.testing.assert_close(rows, expected_rows, rtol=1e-4, atol=1e-4)


def test_a_second_pass_reads_the_prefix_hit_rows_from_the_store(tiny_omni):
    llm = LLM(str(tiny_omni), quantization="none", omni_speech=True, block_size=4)
    prompt = as_prompt(*CASES[1])
    (_, first), = run_and_read_rows(llm, [prompt])
    before = llm.engine.stats().prefix_cache_hit_tokens
    (_, second), = run_and_read_rows(llm, [prompt])
    hit = llm.engine.stats().prefix_cache_hit_tokens - before
    assert hit > 40  # most of the prompt
    # The hit's rows are the very rows the first pass wrote; the rest are computed again.
    assert torch.equal(second[:hit], first[:hit])
    torch.testing.assert_close(second, first, rtol=1e-4, atol=1e-4)


def test_a_prefix_hit_that_ends_mid_item_recomputes_the_rest(tiny_omni):
    llm = LLM(str(tiny_omni), quantization="none", omni_speech=True, block_size=4)
    audio = clip(5, 1.5)
    run_and_read_rows(llm, [as_prompt(f"Hear {AUDIO_PLACEHOLDER} first", [], [audio])])
    # The same clip, then other text: the hit stops at the last whole block, inside the clip.
    text = f"Hear {AUDIO_PLACEHOLDER} then something else"
    (tokens, rows), = run_and_read_rows(llm, [as_prompt(text, [], [audio])])
    probe = llm.engine.make_request(as_prompt(text, [], [audio]), SamplingParams(), request_id="probe")
    llm.engine.discard_unadded_items()
    item = probe.mm_placeholders[0]
    assert item.offset < llm.engine.stats().prefix_cache_hit_tokens < item.end + 4
    expected_tokens, expected_rows = reference_rows(tiny_omni, text, [], [audio])
    assert tokens == expected_tokens
    torch.testing.assert_close(rows, expected_rows, rtol=1e-4, atol=1e-4)


def test_two_identical_requests_in_one_step(tiny_omni):
    # The second hits blocks the first publishes in the same step, before the forward that
    # writes their rows: read after the step, both see the rows.
    llm = LLM(str(tiny_omni), quantization="none", omni_speech=True, block_size=4)
    prompt = as_prompt(*CASES[1])
    (tokens_a, rows_a), (tokens_b, rows_b) = run_and_read_rows(llm, [prompt, prompt])
    expected_tokens, expected_rows = reference_rows(tiny_omni, *CASES[1])
    assert tokens_a == tokens_b == expected_tokens
    torch.testing.assert_close(rows_a, expected_rows, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rows_b, rows_a, rtol=1e-4, atol=1e-4)
    assert llm.engine.stats().prefix_cache_hit_tokens > 0


def test_evicted_and_reused_blocks_never_serve_stale_rows(tiny_omni):
    llm = LLM(str(tiny_omni), quantization="none", omni_speech=True, block_size=4, num_kv_blocks=24)
    first = as_prompt(*CASES[1])
    run_and_read_rows(llm, [first])
    # Other prompts take every block: the first prompt's blocks are evicted and rewritten.
    for seed in range(3):
        run_and_read_rows(llm, [as_prompt(f"Hear {AUDIO_PLACEHOLDER} now", [], [clip(20 + seed, 1.5)])])
    (tokens, rows), = run_and_read_rows(llm, [first])
    expected_tokens, expected_rows = reference_rows(tiny_omni, *CASES[1])
    assert tokens == expected_tokens
    torch.testing.assert_close(rows, expected_rows, rtol=1e-4, atol=1e-4)


def test_the_store_is_sized_from_the_model_and_bounded(tiny_omni):
    assert LLM(str(tiny_omni), quantization="none").engine.core.executor.runner.hidden_store is None  # text only
    llm = LLM(str(tiny_omni), quantization="none", omni_speech=True, block_size=4, num_kv_blocks=24)
    store = llm.engine.core.executor.runner.hidden_store
    assert store.rows.shape == (24 * 4, 64)  # every KV slot, the thinker's width
    with pytest.raises(ValueError, match="hidden-state store needs"):
        LLM(str(tiny_omni), quantization="none", omni_speech=True, num_kv_blocks=4096,
            hidden_state_store_gib=0.0001)

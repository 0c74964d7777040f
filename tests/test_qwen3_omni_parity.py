"""Greedy parity with transformers for Qwen3-Omni's thinker, offline (the LLM API).

A tiny random-weight Qwen3-Omni checkpoint (MoE thinker with its audio and vision towers,
talker, code2wav) built in the session. The engine serves the thinker: audio clips and images
are encoder items, an image's rows carrying its deepstack levels. Its tokens must equal
transformers' `generate` (the full model, text only) for text, an audio clip, two clips, an
image, and audio with an image, whatever the token budget (chunks that cut through an item),
block size, prefix cache state (a second pass from the caches) or preemption.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from engine import LLM, SamplingParams
from engine.adapters import adapter_for
from engine.adapters.qwen3_omni import Qwen3OmniAdapter
from tests.omni_reference import hf_omni_inputs, hf_omni_thinker_greedy, load_processor, load_reference_omni
from tests.qwen3_omni_models import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, SAMPLE_RATE, save_tiny_qwen3_omni
from tests.test_omni_parity import as_prompt, clip, picture

MAX_TOKENS = 6

# Clips shorter and longer than the tower's 1 s chunk, in different requests: the encoder
# batches them together, which must not change either's embeddings. Two clips in one prompt
# are as long as each other (transformers' processor pads a prompt's clips to the longest).
PROMPTS = [
    ("Describe the river stone.", [], []),
    (f"Hear {AUDIO_PLACEHOLDER} then tell", [], [clip(2)]),
    (f"Short {AUDIO_PLACEHOLDER} clip", [], [clip(9, 0.5)]),
    (f"{IMAGE_PLACEHOLDER}What is in this picture?", [picture(1)], []),
    (f"Compare {AUDIO_PLACEHOLDER} with {IMAGE_PLACEHOLDER} now", [picture(3)], [clip(4, 2.1)]),
    (f"First {AUDIO_PLACEHOLDER} then {AUDIO_PLACEHOLDER} compare", [], [clip(7, 1.1), clip(8, 1.1)]),
]


@pytest.fixture(scope="session")
def tiny_qwen3_omni(tmp_path_factory):
    return save_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny-qwen3-omni") / "qwen3_omni_moe")


def qwen3_adapter(path) -> Qwen3OmniAdapter:
    return adapter_for(path, AutoConfig.from_pretrained(path))


def run(path, prompts=PROMPTS, **config) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), quantization="none", **config)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [out.token_ids for out in llm.generate([as_prompt(*p) for p in prompts], params)], llm


@pytest.fixture(scope="session")
def expected(tiny_qwen3_omni) -> list[list[int]]:
    return [hf_omni_thinker_greedy(tiny_qwen3_omni, text, images, clips, MAX_TOKENS) for text, images, clips in PROMPTS]


@pytest.mark.parametrize("budget,block_size,caching", [(2048, 16, True), (8, 4, True), (13, 16, False)])
def test_thinker_tokens_equal_transformers_with_audio_and_images(tiny_qwen3_omni, expected, budget, block_size,
                                                                 caching):
    tokens, llm = run(tiny_qwen3_omni, max_num_batched_tokens=budget, block_size=block_size,
                      enable_prefix_caching=caching, num_kv_blocks=256)
    assert tokens == expected
    if caching:
        # A second pass is served from the prefix cache (and the encoder cache): same tokens.
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        again = [o.token_ids for o in llm.generate([as_prompt(*p) for p in PROMPTS], params)]
        assert again == expected
        assert llm.engine.stats().prefix_cache_hit_tokens > 0


def test_thinker_parity_under_preemption(tiny_qwen3_omni, expected):
    tokens, llm = run(tiny_qwen3_omni, max_num_batched_tokens=16, block_size=4, num_kv_blocks=26, max_num_seqs=3)
    assert tokens == expected
    assert llm.engine.stats().num_preemptions > 0


def test_audio_embedding_counts_are_the_processors(tiny_qwen3_omni):
    """Around the tower's 100-frame chunks (a frame is 160 samples): the count the adapter
    expands a placeholder to is the number of audio tokens transformers' processor writes."""
    adapter, processor = qwen3_adapter(tiny_qwen3_omni), load_processor(tiny_qwen3_omni)
    for frames in (2, 7, 8, 9, 99, 100, 101, 199, 200, 257):
        samples = clip(frames, frames * 160 / SAMPLE_RATE)
        written = processor(text=[AUDIO_PLACEHOLDER], audio=[samples], return_tensors="pt")["input_ids"][0]
        assert adapter.process_audio(samples, SAMPLE_RATE).num_embeddings == int(
            (written == adapter.audio_token_id).sum()), frames


def test_items_encode_as_transformers_encodes_each_whatever_the_batch(tiny_qwen3_omni):
    """Audio rows are the tower's, an image's rows its embeddings then its deepstack levels;
    a clip shorter than a chunk batched with longer ones still gets its own embeddings."""
    adapter = qwen3_adapter(tiny_qwen3_omni)
    clips, image = [clip(11, 0.5), clip(12, 2.7), clip(13, 0.37)], picture(13)
    items = [adapter.process_audio(clips[0], SAMPLE_RATE), adapter.process_image(image),
             adapter.process_audio(clips[1], SAMPLE_RATE), adapter.process_audio(clips[2], SAMPLE_RATE)]
    ours = adapter.encode_items(adapter.load_encoder(torch.float32, torch.device("cpu")), items)
    thinker = load_reference_omni(tiny_qwen3_omni).thinker
    width = thinker.config.text_config.hidden_size
    assert all(rows.shape[1] == adapter.embedding_size() == width * 3 for rows in ours)
    with torch.no_grad():
        for samples, rows in zip(clips, (ours[0], ours[2], ours[3])):
            inputs = hf_omni_inputs(tiny_qwen3_omni, AUDIO_PLACEHOLDER, [], [samples])
            theirs = thinker.get_audio_features(inputs["input_features"], inputs["feature_attention_mask"])
            torch.testing.assert_close(rows[:, :width], theirs.last_hidden_state, rtol=1e-5, atol=1e-5)
            assert not rows[:, width:].any()
        inputs = hf_omni_inputs(tiny_qwen3_omni, IMAGE_PLACEHOLDER, [image], [])
        theirs = thinker.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        levels = [level[0] for level in theirs.deepstack_features]
        torch.testing.assert_close(ours[1], torch.cat([theirs.pooler_output[0], *levels], dim=-1),
                                   rtol=1e-5, atol=1e-5)


def test_the_same_clip_is_encoded_once_and_its_prefix_is_shared(tiny_qwen3_omni):
    llm = LLM(str(tiny_qwen3_omni), block_size=4, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate(as_prompt(f"Hear {AUDIO_PLACEHOLDER} once", [], [clip(7)]), params)[0]
    second = llm.generate(as_prompt(f"Hear {AUDIO_PLACEHOLDER} once", [], [clip(7)]), params)[0]
    assert llm.engine.stats().encoder_items_encoded == 1
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0


def test_a_clip_too_short_to_hear_is_a_clear_error(tiny_qwen3_omni):
    from engine.media import MediaError

    llm = LLM(str(tiny_qwen3_omni), num_kv_blocks=64)
    # The extractor's STFT reflects half a window (200 samples) at each end: shorter has none.
    for samples in (np.zeros(100, np.float32), np.zeros(200, np.float32)):
        with pytest.raises(MediaError) as error:
            llm.generate(as_prompt(f"{AUDIO_PLACEHOLDER} hi", [], [samples]))
        assert error.value.code == "invalid_audio"
    assert not llm.engine.has_unfinished_requests
    assert len(llm.generate(as_prompt(f"{AUDIO_PLACEHOLDER} hi", [], [clip(1, 0.2)]),
                            SamplingParams(max_tokens=2, temperature=0))[0].token_ids) == 2

"""Greedy parity with transformers for an omni model's thinker, offline (the LLM API).

A tiny random-weight Qwen2.5-Omni checkpoint (thinker, talker and codec, with its real
processors) built in the session. The engine serves the thinker as a multimodal language
model: images and audio clips are encoder items. Its tokens must equal transformers'
`generate` for text, an image, an audio clip, and both, whatever the token budget (chunks that
cut through an audio item), block size, prefix cache state (a second pass from the caches)
or preemption.
"""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest

from engine import LLM, SamplingParams
from tests.omni_models import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, SAMPLE_RATE, save_tiny_omni
from tests.omni_reference import hf_omni_thinker_greedy

MAX_TOKENS = 6


@pytest.fixture(scope="session")
def tiny_omni(tmp_path_factory):
    return save_tiny_omni("qwen2_5_omni", tmp_path_factory.mktemp("tiny-omni") / "qwen2_5_omni")


def picture(seed: int, size=(112, 84)) -> PIL.Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels)


def clip(seed: int, seconds: float = 1.3) -> np.ndarray:
    """Noise with a tone in it, at the model's rate: not speech, but audio the tower has to read."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(SAMPLE_RATE * seconds)) / SAMPLE_RATE
    return (0.3 * np.sin(2 * np.pi * (200 + 50 * seed) * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


PROMPTS = [
    ("Describe the river stone.", [], []),
    (f"{IMAGE_PLACEHOLDER}What is in this picture?", [picture(1)], []),
    (f"Listen to {AUDIO_PLACEHOLDER} and say what it is.", [], [clip(2)]),
    (f"See {IMAGE_PLACEHOLDER} and hear {AUDIO_PLACEHOLDER} then answer", [picture(3)], [clip(4, 2.1)]),
    (f"{AUDIO_PLACEHOLDER}{AUDIO_PLACEHOLDER} two clips", [], [clip(5, 0.7), clip(6, 1.1)]),
]


def as_prompt(text: str, images: list, clips: list) -> dict | str:
    media = {}
    if images:
        media["image"] = images
    if clips:
        media["audio"] = [(samples, SAMPLE_RATE) for samples in clips]
    return {"prompt": text, "multi_modal_data": media} if media else text


def run(path, prompts=PROMPTS, **config) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), quantization="none", **config)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [out.token_ids for out in llm.generate([as_prompt(*p) for p in prompts], params)], llm


@pytest.fixture(scope="session")
def expected(tiny_omni) -> list[list[int]]:
    return [hf_omni_thinker_greedy(tiny_omni, text, images, clips, MAX_TOKENS) for text, images, clips in PROMPTS]


@pytest.mark.parametrize("budget,block_size,caching", [(2048, 16, True), (8, 4, True), (13, 16, False)])
def test_thinker_tokens_equal_transformers_with_images_and_audio(tiny_omni, expected, budget, block_size, caching):
    tokens, llm = run(tiny_omni, max_num_batched_tokens=budget, block_size=block_size,
                      enable_prefix_caching=caching, num_kv_blocks=256)
    assert tokens == expected
    if caching:
        # A second pass is served from the prefix cache (and the encoder cache): same tokens.
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        again = [o.token_ids for o in llm.generate([as_prompt(*p) for p in PROMPTS], params)]
        assert again == expected
        assert llm.engine.stats().prefix_cache_hit_tokens > 0


def test_thinker_parity_under_preemption_and_async_scheduling(tiny_omni, expected):
    tokens, llm = run(tiny_omni, max_num_batched_tokens=16, block_size=4, num_kv_blocks=26, max_num_seqs=3)
    assert tokens == expected
    assert llm.engine.stats().num_preemptions > 0
    tokens, _ = run(tiny_omni, max_num_batched_tokens=16, block_size=4, async_scheduling=True)
    assert tokens == expected


def test_the_same_clip_is_encoded_once_and_its_prefix_is_shared(tiny_omni):
    llm = LLM(str(tiny_omni), block_size=4)
    params = SamplingParams(temperature=0, max_tokens=2)
    shared = clip(7)
    first = llm.generate(as_prompt(f"Hear {AUDIO_PLACEHOLDER} once", [], [shared]), params)[0]
    second = llm.generate(as_prompt(f"Hear {AUDIO_PLACEHOLDER} once", [], [shared]), params)[0]
    stats = llm.engine.stats()
    assert stats.encoder_items_encoded == 1
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    # Another clip at the same place shares only the blocks before it.
    other = llm.generate(as_prompt(f"Hear {AUDIO_PLACEHOLDER} once", [], [clip(8)]), params)[0]
    probe = llm.engine.make_request(as_prompt(f"Hear {AUDIO_PLACEHOLDER} once", [], [clip(8)]), params,
                                    request_id="probe")
    llm.engine.discard_unadded_items()
    assert other.num_cached_tokens == probe.mm_placeholders[0].offset // 4 * 4


def test_bad_audio_is_a_clear_error_and_leaves_nothing_behind(tiny_omni):
    from engine.media import MediaError

    llm = LLM(str(tiny_omni))
    text = f"{AUDIO_PLACEHOLDER} hi"
    with pytest.raises(MediaError) as error:
        llm.generate(as_prompt(text, [], [np.zeros((2, 100), np.float32)]))
    assert error.value.code == "invalid_audio"
    with pytest.raises(MediaError) as error:
        llm.generate({"prompt": text, "multi_modal_data": {"audio": [(np.full(100, np.nan, np.float32), 16000)]}})
    assert error.value.code == "invalid_audio"
    with pytest.raises(ValueError, match="longer than this model's 30 s window"):
        llm.generate(as_prompt(text, [], [np.zeros(31 * SAMPLE_RATE, np.float32)]))
    with pytest.raises(ValueError, match="audio placeholder"):
        llm.generate(as_prompt("no placeholder here", [], [clip(1)]))
    with pytest.raises(MediaError) as error:
        llm.generate(as_prompt(AUDIO_PLACEHOLDER * 9, [], [clip(1, 0.2)] * 9))
    assert error.value.code == "too_many_audio_clips"
    assert not llm.engine.has_unfinished_requests and not llm.engine._items
    out = llm.generate(as_prompt(text, [], [clip(1)]), SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].token_ids) == 2


def test_a_clip_at_another_rate_is_resampled_and_named_by_what_was_sent(tiny_omni):
    llm = LLM(str(tiny_omni))
    adapter = llm.engine.adapter
    at_8k = clip(9)[::2].copy()
    item = adapter.process_audio(at_8k, 8000)
    assert item.num_embeddings == adapter.process_audio(clip(9), SAMPLE_RATE).num_embeddings
    assert item.mm_hash != adapter.process_audio(at_8k, 16000).mm_hash


def test_an_audio_item_larger_than_the_encoder_budget_is_a_clear_error_not_a_hang(tiny_omni):
    llm = LLM(str(tiny_omni), encoder_cache_size=20)  # a 1.3 s clip makes 33 embeddings
    with pytest.raises(ValueError, match="larger than the encoder cache budget"):
        llm.generate(as_prompt(f"{AUDIO_PLACEHOLDER} hi", [], [clip(1)]))
    assert not llm.engine.has_unfinished_requests
    assert len(llm.generate("text still works", SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_a_vision_model_refuses_audio(tmp_path):
    from tests.tiny_vlms import save_tiny_vlm

    llm = LLM(str(save_tiny_vlm("qwen2_vl", tmp_path / "vlm")))
    with pytest.raises(ValueError, match="takes no audio"):
        llm.generate(as_prompt("hi", [], [clip(1)]))


def test_a_batch_of_mixed_items_encodes_as_transformers_encodes_each(tiny_omni):
    import torch

    from tests.omni_reference import hf_omni_inputs, load_reference_omni

    llm = LLM(str(tiny_omni))
    adapter = llm.engine.adapter
    clips, image = [clip(11, 0.5), clip(12, 2.7)], picture(13)
    items = [adapter.process_audio(clips[0], SAMPLE_RATE), adapter.process_image(image),
             adapter.process_audio(clips[1], SAMPLE_RATE)]
    ours = adapter.encode_items(adapter.load_encoder(torch.float32, torch.device("cpu")), items)
    thinker = load_reference_omni(tiny_omni).thinker
    with torch.no_grad():
        for samples, embeddings in zip(clips, (ours[0], ours[2])):
            inputs = hf_omni_inputs(tiny_omni, AUDIO_PLACEHOLDER, [], [samples])
            theirs = thinker.get_audio_features(inputs["input_features"], inputs["feature_attention_mask"])
            torch.testing.assert_close(embeddings, theirs.last_hidden_state, rtol=1e-5, atol=1e-5)
        inputs = hf_omni_inputs(tiny_omni, IMAGE_PLACEHOLDER, [image], [])
        theirs = thinker.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output[0]
        torch.testing.assert_close(ours[1], theirs, rtol=1e-5, atol=1e-5)

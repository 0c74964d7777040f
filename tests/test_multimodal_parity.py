"""Greedy parity with transformers for prompts with images, offline (the LLM API).

Tiny random-weight Qwen2-VL, Qwen2.5-VL and LLaVA checkpoints with their real processors,
built in the session. The engine's tokens must equal transformers' `generate` with the same
images, whatever the token budget (chunks that cut through an image), block size, prefix
cache state (a second pass from the caches) or preemption.
"""

from __future__ import annotations

import PIL.Image
import numpy as np
import pytest

from engine import LLM, SamplingParams
from tests.tiny_vlms import save_tiny_vlm
from tests.vlm_reference import hf_vlm_greedy

MAX_TOKENS = 6


@pytest.fixture(scope="session")
def tiny_vlms(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny-vlms")
    return {family: save_tiny_vlm(family, root / family) for family in ("qwen2_vl", "qwen2_5_vl", "llava")}


def picture(seed: int, size=(112, 84)) -> PIL.Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels)


def prompts_for(llm: LLM) -> list[tuple[str, list]]:
    """Zero, one and two images; image first, in the middle and last."""
    image = llm.engine.adapter.image_placeholder_text
    return [
        ("Describe the river stone.", []),
        (f"{image}What is in this picture?", [picture(1)]),
        (f"Look closely at {image} and tell me the colour.", [picture(2)]),
        (f"Compare {image} with {image} please", [picture(3), picture(4, (84, 112))]),
        (f"The last thing is an image: {image}", [picture(5)]),
    ]


def as_prompt(text: str, images: list) -> dict | str:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def run(path, prompts, **config) -> list[list[int]]:
    llm = LLM(str(path), **config)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [out.token_ids for out in llm.generate([as_prompt(t, i) for t, i in prompts], params)], llm


@pytest.fixture(scope="session")
def references(tiny_vlms) -> dict:
    out = {}
    for family, path in tiny_vlms.items():
        llm = LLM(str(path), num_kv_blocks=64)
        prompts = prompts_for(llm)
        out[family] = (prompts, [hf_vlm_greedy(path, text, images, MAX_TOKENS) for text, images in prompts])
    return out


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava"])
@pytest.mark.parametrize("budget,block_size,caching", [(2048, 16, True), (8, 4, True), (13, 16, False)])
def test_greedy_tokens_equal_transformers_with_images(tiny_vlms, references, family, budget, block_size, caching):
    prompts, expected = references[family]
    tokens, llm = run(tiny_vlms[family], prompts, max_num_batched_tokens=budget, block_size=block_size,
                      enable_prefix_caching=caching, num_kv_blocks=256)
    assert tokens == expected
    if caching:
        # A second pass is served from the prefix cache (and the encoder cache): same tokens.
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        again = [o.token_ids for o in llm.generate([as_prompt(t, i) for t, i in prompts], params)]
        assert again == expected
        assert llm.engine.stats().prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_greedy_parity_under_preemption_and_async_scheduling(tiny_vlms, references, family):
    prompts, expected = references[family]
    tokens, llm = run(tiny_vlms[family], prompts, max_num_batched_tokens=16, block_size=4, num_kv_blocks=24,
                      max_num_seqs=3)
    assert tokens == expected
    assert llm.engine.stats().num_preemptions > 0
    tokens, _ = run(tiny_vlms[family], prompts, max_num_batched_tokens=16, block_size=4, async_scheduling=True)
    assert tokens == expected


def test_the_same_image_is_encoded_once_across_requests(tiny_vlms):
    llm = LLM(str(tiny_vlms["qwen2_vl"]), enable_prefix_caching=False)
    image = llm.engine.adapter.image_placeholder_text
    shared = picture(7)
    params = SamplingParams(temperature=0, max_tokens=2)
    # Four at once share one ask of the encoder...
    llm.generate([as_prompt(f"Request {i}: {image}", [shared]) for i in range(4)], params)
    assert llm.engine.stats().encoder_items_requested == 1
    # ...and a later request, with the image at another offset, finds it in the encoder cache.
    llm.generate(as_prompt(f"The same picture at another offset, later in the text {image}", [shared]), params)
    stats = llm.engine.stats()
    assert stats.encoder_items_encoded == 1
    assert (stats.encoder_cache_queries, stats.encoder_cache_hits) == (2, 1)
    assert stats.image_tokens_in == 5 * 12


def test_two_images_where_only_the_second_differs_share_the_prefix_up_to_it(tiny_vlms):
    llm = LLM(str(tiny_vlms["qwen2_vl"]), block_size=4)
    image = llm.engine.adapter.image_placeholder_text
    params = SamplingParams(temperature=0, max_tokens=2)
    text = f"First {image} then second {image} done"
    first = llm.generate(as_prompt(text, [picture(10), picture(11)]), params)[0]
    second = llm.generate(as_prompt(text, [picture(10), picture(12)]), params)[0]
    prompt = llm.engine.make_request(as_prompt(text, [picture(10), picture(12)]), params, request_id="probe")
    llm.engine.discard_unadded_items()
    second_image = prompt.mm_placeholders[1]
    assert first.num_cached_tokens == 0
    # Every full block before the second image, and none past its start.
    assert second.num_cached_tokens == second_image.offset // 4 * 4
    assert llm.engine.stats().encoder_items_encoded == 3


def test_chat_with_image_parts(tiny_vlms, tmp_path):
    import base64
    import io

    path = tiny_vlms["qwen2_vl"]
    image = picture(20)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    llm = LLM(str(path))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    by_url = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                                     {"type": "text", "text": "What is this?"}]}], params)[0]
    by_image = llm.chat([{"role": "user", "content": [{"type": "image", "image": image},
                                                       {"type": "text", "text": "What is this?"}]}], params)[0]
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
        add_generation_prompt=True, tokenize=False)
    assert by_url.token_ids == by_image.token_ids == hf_vlm_greedy(path, text, [image], MAX_TOKENS)


def test_bad_images_are_clear_errors_and_leave_nothing_behind(tiny_vlms):
    from engine.media import MediaError

    llm = LLM(str(tiny_vlms["llava"]))
    image = llm.engine.adapter.image_placeholder_text
    with pytest.raises(MediaError) as error:
        llm.generate(as_prompt(f"{image} hi", [b"not an image"]))
    assert error.value.code == "invalid_image"
    with pytest.raises(ValueError, match="image"):
        llm.generate(as_prompt("no placeholder here", [picture(1)]))
    with pytest.raises(MediaError) as error:
        llm.generate(as_prompt(image * 9, [picture(1)] * 9))
    assert error.value.code == "too_many_images"
    assert not llm.engine.has_unfinished_requests and not llm.engine._items
    out = llm.generate(as_prompt(f"{image} fine", [picture(1)]), SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].token_ids) == 2


def test_text_only_model_refuses_images(tiny_llama):
    llm = LLM(str(tiny_llama))
    with pytest.raises(ValueError, match="takes no images"):
        llm.generate(as_prompt("hi", [picture(1)]))


def test_identical_requests_whose_shared_last_block_holds_the_image_end(tiny_vlms, references):
    # seed 003: the prompt is a whole number of blocks, the image ends in its last block and
    # the token budget splits the image. The second request's prefix hit stops one block
    # short and recomputes image tokens in the same step as the first one's last chunk.
    path = tiny_vlms["qwen2_vl"]
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=10)
    image = llm.engine.adapter.image_placeholder_text
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for padding in range(4):
        text = "x" * padding + f"Look {image}"
        probe = llm.engine.make_request(as_prompt(text, [picture(30)]), params, request_id=f"probe-{padding}")
        llm.engine.discard_unadded_items()
        item = probe.mm_placeholders[0]
        if len(probe.prompt_token_ids) % 4 == 0 and item.end > len(probe.prompt_token_ids) - 4:
            break
    else:
        pytest.fail("no padding made the prompt a whole number of blocks ending in the image")
    outs = llm.generate([as_prompt(text, [picture(30)])] * 2, params)
    expected = hf_vlm_greedy(path, text, [picture(30)], MAX_TOKENS)
    assert [o.token_ids for o in outs] == [expected, expected]
    assert outs[1].num_cached_tokens > 0
    assert llm.engine.stats().encoder_items_encoded == 1


def test_an_image_larger_than_the_encoder_budget_is_a_clear_error_not_a_hang(tiny_vlms):
    llm = LLM(str(tiny_vlms["qwen2_vl"]), encoder_cache_size=8)  # the image makes 12 embeddings
    image = llm.engine.adapter.image_placeholder_text
    with pytest.raises(ValueError, match="larger than the encoder cache budget"):
        llm.generate(as_prompt(f"{image} hi", [picture(1)]))
    assert not llm.engine.has_unfinished_requests
    assert len(llm.generate("text still works", SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_a_batch_with_one_refused_image_queues_nothing(tiny_vlms):
    llm = LLM(str(tiny_vlms["qwen2_vl"]), encoder_cache_size=12)
    image = llm.engine.adapter.image_placeholder_text
    big = picture(40, (224, 224))  # more than 12 embeddings
    with pytest.raises(ValueError, match="larger than the encoder cache budget"):
        llm.generate([as_prompt(f"{image} a", [picture(1)]), as_prompt(f"{image} b", [big]), "text"])
    assert not llm.engine.has_unfinished_requests and not llm.engine._items
    out = llm.generate("next", SamplingParams(max_tokens=2))
    assert len(out) == 1 and len(out[0].token_ids) == 2


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_greedy_parity_with_images_through_the_triton_kernels(tiny_vlms, references, family):
    """The GPU path's kernels (in Triton's interpreter here) with images: chunks ending inside
    an image, M-RoPE positions, single-token rows reordered first, a prefix-cache pass."""
    prompts, expected = references[family]
    tokens, llm = run(tiny_vlms[family], prompts, max_num_batched_tokens=8, block_size=4, num_kv_blocks=256,
                      attention_backend="triton")
    assert tokens == expected
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert [o.token_ids for o in llm.generate([as_prompt(t, i) for t, i in prompts], params)] == expected
    assert llm.engine.stats().prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
@pytest.mark.parametrize("mode", ["bf16", "int4"])
def test_the_fast_cpu_modes_serve_images_with_their_output_layer(tiny_vlms, family, mode, monkeypatch):
    """The language model an adapter loads goes through the same CPU conversion: its output
    matrix becomes the bfloat16 one with float32 candidates, and a bias row still wins."""
    from workers.cpu import linear_modes
    from workers.cpu.int4 import Int4Linear
    from workers.cpu.output_layer import RescoredOutputLayer

    monkeypatch.setattr(linear_modes, "cpu_has_native_bf16", lambda: True)
    llm = LLM(str(tiny_vlms[family]), quantization=mode)
    model = llm.engine.core.executor.model
    assert isinstance(model.get_output_embeddings(), RescoredOutputLayer)
    assert any(isinstance(m, Int4Linear) for m in model.modules()) == (mode == "int4")
    image = llm.engine.adapter.image_placeholder_text
    plain, biased = llm.generate([as_prompt(f"Look: {image}", [picture(3)])] * 2, [
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={11: 100.0}, logprobs=2)])
    assert len(plain.token_ids) == 4 and biased.token_ids == [11] * 4

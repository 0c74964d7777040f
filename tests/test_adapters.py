"""Model adapters agree with transformers on tiny random Qwen2-VL, Qwen2.5-VL and LLaVA checkpoints:
the same expanded prompts, pixel values, image embeddings, M-RoPE positions, logits and greedy
tokens, with the language model driven by inputs_embeds the way the decoder drives it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import AttentionInterface, AutoConfig, AutoTokenizer, LlamaConfig, Qwen2Config
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engine.adapters import adapter_for
from engine.adapters.llava import LlavaAdapter
from engine.adapters.qwen2_vl import Qwen2VLAdapter
from tests.tiny_vlms import FAMILIES, save_tiny_vlm
from tests.vlm_reference import hf_processor_inputs, hf_vlm_greedy, load_reference_vlm

QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_vlms(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny-vlms")
    return {family: save_tiny_vlm(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="session")
def adapters(tiny_vlms) -> dict:
    return {family: adapter_for(path, AutoConfig.from_pretrained(path)) for family, path in tiny_vlms.items()}


def random_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB").convert(mode)


def chat_prompt(path, parts: list) -> str:
    """The chat template's text for one user message made of `parts` (strings are text parts,
    None an image part), as the frontend renders it."""
    content = [{"type": "image"} if part is None else {"type": "text", "text": part} for part in parts]
    return AutoTokenizer.from_pretrained(path).apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)


def engine_prompt(adapter, path, prompt_text: str, images: list):
    """The engine's path: tokenize the rendered text, process each image, expand placeholders."""
    token_ids = AutoTokenizer.from_pretrained(path)(prompt_text, add_special_tokens=False)["input_ids"]
    processed = [adapter.process_image(image) for image in images]
    expanded, placeholders = adapter.expand_placeholders(token_ids, processed)
    return expanded, placeholders, processed


# Prompts by layout. The raw ones put image rows at the very start or end of the prompt (the
# chat template always wraps them in text); sizes differ so the images' grids differ.
def layout(name: str, adapter, path) -> tuple[str, list]:
    pad = adapter.image_placeholder_text
    if name == "image_first":
        return pad + "What is in the picture?", [random_image(112, 84)]
    if name == "image_last":
        return "Look at this: " + pad, [random_image(84, 112, seed=1)]
    if name == "two_images":
        return (chat_prompt(path, [None, "and then", None, "which is larger?"]),
                [random_image(112, 84), random_image(56, 56, seed=2)])
    raise ValueError(name)


LAYOUTS = ("image_first", "image_last", "two_images")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", LAYOUTS)
def test_expanded_prompt_equals_processor(tiny_vlms, adapters, family, name):
    path, adapter = tiny_vlms[family], adapters[family]
    prompt_text, images = layout(name, adapter, path)
    expanded, placeholders, processed = engine_prompt(adapter, path, prompt_text, images)
    reference = hf_processor_inputs(path, prompt_text, images)
    assert expanded == reference["input_ids"][0].tolist()
    assert [p.length for p in placeholders] == [image.num_embeddings for image in processed]
    for placeholder, image in zip(placeholders, processed):
        assert set(expanded[placeholder.offset:placeholder.end]) == {adapter.image_token_id}
        assert placeholder.mm_hash == image.mm_hash and placeholder.grid == image.grid
    # The pixels the encoder gets are the processor's, image by image.
    ours = np.concatenate([image.tower_input for image in processed]) if family != "llava" else \
        np.stack([image.tower_input for image in processed])
    np.testing.assert_array_equal(ours, reference["pixel_values"].numpy())


def test_expand_placeholders_rejects_a_count_mismatch(tiny_vlms, adapters):
    adapter = adapters["qwen2_vl"]
    image = adapter.process_image(random_image(56, 56))
    with pytest.raises(ValueError, match="1 image placeholder.*2 image"):
        adapter.expand_placeholders([5, adapter.image_token_id, 6], [image, image])
    with pytest.raises(ValueError, match="0 image placeholder.*1 image"):
        adapter.expand_placeholders([5, 6], [image])


@pytest.mark.parametrize("family", FAMILIES)
def test_encode_items_equals_get_image_features(tiny_vlms, adapters, family):
    path, adapter = tiny_vlms[family], adapters[family]
    prompt_text, images = layout("two_images", adapter, path)
    processed = [adapter.process_image(image) for image in images]
    ours = adapter.encode_items(adapter.load_encoder(torch.float32, torch.device("cpu")), processed)

    inputs = hf_processor_inputs(path, prompt_text, images)
    model = load_reference_vlm(path)
    with torch.no_grad():
        if family == "llava":
            theirs = model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
        else:
            theirs = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    assert [e.shape for e in ours] == [(image.num_embeddings, adapter.embedding_size()) for image in processed]
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", QWEN_FAMILIES)
@pytest.mark.parametrize("name", LAYOUTS)
def test_prompt_positions_equal_get_rope_index(tiny_vlms, adapters, family, name):
    path, adapter = tiny_vlms[family], adapters[family]
    prompt_text, images = layout(name, adapter, path)
    expanded, placeholders, _ = engine_prompt(adapter, path, prompt_text, images)
    positions, delta = adapter.prompt_positions(len(expanded), placeholders)

    inputs = hf_processor_inputs(path, prompt_text, images)
    reference, reference_delta = load_reference_vlm(path).model.get_rope_index(
        inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"])
    assert positions.dtype == np.int64
    np.testing.assert_array_equal(positions, reference[:, 0].numpy())
    assert delta == int(reference_delta[0, 0]) and delta < 0  # images are shorter in positions than tokens


def test_prompt_positions_of_text_alone_count_up(adapters):
    positions, delta = adapters["qwen2_vl"].prompt_positions(5, [])
    np.testing.assert_array_equal(positions, np.tile(np.arange(5), (3, 1)))
    assert delta == 0


def language_model_inputs(adapter, language_model, expanded, placeholders, embeddings, generated=()):
    """What the decoder hands the language model: token embeddings with each image's rows
    replaced by its encoder output, and positions ([3, 1, T] M-RoPE or [1, T])."""
    token_ids = list(expanded) + list(generated)
    with torch.no_grad():
        inputs_embeds = language_model.get_input_embeddings()(torch.tensor([token_ids]))
    for placeholder, rows in zip(placeholders, embeddings):
        inputs_embeds[0, placeholder.offset:placeholder.end] = rows
    if adapter.uses_mrope:
        prompt_positions, delta = adapter.prompt_positions(len(expanded), placeholders)
        later = np.arange(len(expanded), len(token_ids)) + delta
        positions = np.concatenate([prompt_positions, np.tile(later, (3, 1))], axis=1)
        position_ids = torch.from_numpy(positions)[:, None, :]
    else:
        position_ids = torch.arange(len(token_ids))[None, :]
    return inputs_embeds, position_ids


@pytest.mark.parametrize("family", FAMILIES)
def test_language_model_on_adapter_embeddings_gives_full_model_logits(tiny_vlms, adapters, family):
    path, adapter = tiny_vlms[family], adapters[family]
    prompt_text, images = layout("two_images", adapter, path)
    expanded, placeholders, processed = engine_prompt(adapter, path, prompt_text, images)
    embeddings = adapter.encode_items(adapter.load_encoder(torch.float32, torch.device("cpu")), processed)
    language_model = adapter.load_language_model(torch.float32, "cpu", "eager")
    inputs_embeds, position_ids = language_model_inputs(adapter, language_model, expanded, placeholders, embeddings)
    with torch.no_grad():
        ours = language_model(inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=False).logits
        theirs = load_reference_vlm(path)(**hf_processor_inputs(path, prompt_text, images), use_cache=False).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_through_adapter_equals_generate(tiny_vlms, adapters, family):
    """Generated tokens sit at t + delta: the decode steps agree with generate, not only the prompt."""
    path, adapter = tiny_vlms[family], adapters[family]
    prompt_text, images = layout("two_images", adapter, path)
    expanded, placeholders, processed = engine_prompt(adapter, path, prompt_text, images)
    embeddings = adapter.encode_items(adapter.load_encoder(torch.float32, torch.device("cpu")), processed)
    language_model = adapter.load_language_model(torch.float32, "cpu", "eager")
    generated: list[int] = []
    for _ in range(6):
        inputs_embeds, position_ids = language_model_inputs(adapter, language_model, expanded, placeholders,
                                                            embeddings, generated)
        with torch.no_grad():
            logits = language_model(inputs_embeds=inputs_embeds, position_ids=position_ids, logits_to_keep=1,
                                    use_cache=False).logits
        generated.append(int(logits[0, -1].argmax()))
    assert generated == hf_vlm_greedy(path, prompt_text, images, max_new_tokens=6)


CALLS: list[int] = []


def counting_attention(module, query, key, value, attention_mask, **kwargs):
    CALLS.append(module.layer_idx)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_language_model_uses_the_requested_attention_and_drops_the_tower(tiny_vlms, adapters, family):
    AttentionInterface.register("antiphon_test_counting", counting_attention)
    adapter = adapters[family]
    language_model = adapter.load_language_model(torch.float32, "cpu", "antiphon_test_counting")
    assert not any(name.startswith(("model.visual", "model.vision_tower", "model.multi_modal_projector"))
                   for name, _ in language_model.named_parameters())
    CALLS.clear()
    length = 7
    position_ids = torch.arange(length).expand(3, 1, length) if adapter.uses_mrope else torch.arange(length)[None]
    with torch.no_grad():
        language_model(inputs_embeds=torch.randn(1, length, adapter.embedding_size()), position_ids=position_ids,
                       use_cache=False)
    assert CALLS == [0, 1]


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_encoder_holds_only_the_tower_and_projector(tiny_vlms, adapters, family):
    encoder = adapters[family].load_encoder(torch.float32, torch.device("cpu"))
    reference = load_reference_vlm(tiny_vlms[family]).model
    towers = [reference.visual] if family != "llava" else [reference.vision_tower, reference.multi_modal_projector]
    assert sum(p.numel() for p in encoder.parameters()) == sum(p.numel() for t in towers for p in t.parameters())
    assert not any("language_model" in name or "lm_head" in name for name, _ in encoder.named_parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_mm_hash_names_the_pixels_and_how_they_are_processed(tiny_vlms, adapters, family, tmp_path):
    adapter = adapters[family]
    image = random_image(112, 84)
    same = adapter.mm_hash(random_image(112, 84))
    assert adapter.mm_hash(image) == same == adapter.process_image(image).mm_hash

    changed = image.copy()
    changed.putpixel((5, 7), tuple((v + 1) % 256 for v in image.getpixel((5, 7))))
    resized = Image.frombytes("RGB", (84, 112), image.tobytes())  # same bytes, other shape
    other_mode = Image.frombytes("YCbCr", image.size, image.tobytes())  # same bytes, other mode
    hashes = {adapter.mm_hash(variant) for variant in (changed, resized, other_mode)}
    assert len(hashes) == 3 and same not in hashes

    # Same palette indices, another palette: other RGB pixels, another hash.
    paletted = image.convert("P")
    repainted = paletted.copy()
    repainted.putpalette([255 - v for v in paletted.getpalette()])
    assert adapter.mm_hash(paletted) != adapter.mm_hash(repainted)

    # Another processor setting (the normalization mean) changes the pixels the tower sees.
    folder = shutil.copytree(tiny_vlms[family], tmp_path / "changed-processor")
    config_file = folder / ("processor_config.json" if family == "llava" else "preprocessor_config.json")
    settings = json.loads(config_file.read_text())
    (settings["image_processor"] if family == "llava" else settings)["image_mean"] = [0.5, 0.5, 0.5]
    config_file.write_text(json.dumps(settings))
    assert adapter_for(folder, AutoConfig.from_pretrained(folder)).mm_hash(image) != same


def test_mm_hash_differs_between_families(adapters):
    image = random_image(56, 56)
    assert len({adapter.mm_hash(image) for adapter in adapters.values()}) == len(adapters)


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_max_embeddings_bounds_every_image_and_is_reached(adapters, family):
    adapter = adapters[family]
    # The tiny processor allows 16 embeddings by area, but an image at the 200:1 limit keeps a
    # 28-pixel short side and makes one long row of 56.
    assert adapter.max_embeddings_per_item() == 56
    assert adapter.process_image(random_image(5600, 28)).num_embeddings == 56
    for width, height in [(224, 224), (1000, 700), (28, 28), (3, 500), (100, 20), (4000, 30)]:
        assert adapter.process_image(random_image(width, height)).num_embeddings <= 56


def test_llava_images_all_make_the_same_count(adapters):
    adapter = adapters["llava"]
    assert adapter.max_embeddings_per_item() == 16
    sizes = [(56, 56), (300, 90), (20, 40)]
    assert {adapter.process_image(random_image(w, h)).num_embeddings for w, h in sizes} == {16}


def test_adapter_for_picks_the_family(adapters):
    assert isinstance(adapters["qwen2_vl"], Qwen2VLAdapter) and adapters["qwen2_vl"].uses_mrope
    assert isinstance(adapters["qwen2_5_vl"], Qwen2VLAdapter) and adapters["qwen2_5_vl"].family == "qwen2_5_vl"
    assert isinstance(adapters["llava"], LlavaAdapter) and not adapters["llava"].uses_mrope
    assert adapters["llava"].image_placeholder_text == "<image>"
    # Text-only families have no adapter (and need no processor files).
    assert adapter_for("/nonexistent", LlamaConfig()) is None
    assert adapter_for("/nonexistent", Qwen2Config()) is None


def test_vision_encoder_refuses_a_checkpoint_without_tower_weights(tiny_vlms, tmp_path):
    """A tower weight missing from the checkpoint would silently stay random: an error instead."""
    folder = shutil.copytree(tiny_vlms["qwen2_vl"], tmp_path / "no-merger")
    weights = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "merger" not in k}, folder / "model.safetensors",
              metadata={"format": "pt"})
    adapter = adapter_for(folder, AutoConfig.from_pretrained(folder))
    with pytest.raises(ValueError, match="lacks vision weights.*merger"):
        adapter.load_encoder(torch.float32, torch.device("cpu"))

"""Spoken answers from an omni model, offline: thinker -> talker -> codec.

With a greedy thinker and a greedy talker, the text tokens, the talker's codec tokens and the
codec's waveform equal transformers' Qwen2.5-Omni `generate` (the codec starts from noise: both
sides draw it after the same seed, so the waveforms are equal to float tolerance). The talker
runs as a second engine core, fed the thinker's rows step by step: answers batched together
equal answers alone, whatever the block size; a prompt with an image and a clip takes the
talker's M-RoPE positions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.thinker_rows import TalkerPrompt
from tests.omni_models import AUDIO_PLACEHOLDER, CODEC_EOS, CODEC_PAD, IMAGE_PLACEHOLDER, save_tiny_omni
from tests.omni_reference import hf_omni_spoken_greedy
from tests.test_omni_parity import as_prompt, clip, picture

MAX_TOKENS, MAX_CODES, SEED = 6, 40, 123
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
CASES = [
    (CHAT.format("Once upon a time"), [], []),
    (CHAT.format(f"See {IMAGE_PLACEHOLDER} and hear {AUDIO_PLACEHOLDER}"), [picture(3)], [clip(4, 1.2)]),
]


@pytest.fixture(scope="module")
def tiny_omni(tmp_path_factory):
    return save_tiny_omni("qwen2_5_omni", tmp_path_factory.mktemp("omni-speech") / "qwen2_5_omni")


@pytest.fixture(scope="module")
def expected(tiny_omni):
    return [hf_omni_spoken_greedy(tiny_omni, text, images, clips, MAX_TOKENS, MAX_CODES, "Chelsie", SEED)
            for text, images, clips in CASES]


def speak(llm: LLM, cases) -> list:
    torch.manual_seed(SEED)  # one answer at a time through the codec: the same noise as the reference
    return llm.generate([as_prompt(*case) for case in cases], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                            ignore_eos=True),
                        voice="Chelsie", talker_params=SamplingParams(temperature=0, max_tokens=MAX_CODES))


@pytest.mark.parametrize("block_size", [4, 16])
def test_text_codes_and_waveform_equal_transformers(tiny_omni, expected, block_size):
    llm = LLM(str(tiny_omni), quantization="none", omni_speech=True, block_size=block_size)
    for case, (tokens, codes, waveform) in zip(CASES, expected):
        out, = speak(llm, [case])
        assert out.token_ids == tokens
        assert out.codec_token_ids == codes
        assert out.sample_rate == 24000
        np.testing.assert_allclose(out.audio, waveform.numpy(), rtol=1e-4, atol=1e-5)


def test_answers_spoken_together_equal_each_alone(tiny_omni, expected):
    llm = LLM(str(tiny_omni), quantization="none", omni_speech=True, block_size=4)
    outs = speak(llm, CASES)
    assert [(o.token_ids, o.codec_token_ids) for o in outs] == [(t, c) for t, c, _ in expected]


def test_an_unknown_voice_is_a_clear_error(tiny_omni):
    llm = LLM(str(tiny_omni), quantization="none", omni_speech=True)
    with pytest.raises(ValueError, match="unknown voice 'Nobody'"):
        llm.generate("hi", SamplingParams(max_tokens=2), voice="Nobody")


def test_the_talker_s_repetition_penalty_matches_transformers(tiny_omni):
    # Qwen2.5-Omni's default for its talker is 1.05, over its prompt's codes and its own.
    tokens, codes, _ = hf_omni_spoken_greedy(tiny_omni, *CASES[0], MAX_TOKENS, MAX_CODES, "Chelsie", SEED,
                                             repetition_penalty=1.3)
    llm = LLM(str(tiny_omni), quantization="none", omni_speech=True)
    out, = llm.generate(as_prompt(*CASES[0]), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        voice="Chelsie",
                        talker_params=SamplingParams(temperature=0, max_tokens=MAX_CODES, repetition_penalty=1.3))
    assert (out.token_ids, out.codec_token_ids) == (tokens, codes)


def test_a_talker_that_ends_first_and_a_one_token_answer(tiny_omni):
    llm = LLM(str(tiny_omni), quantization="none", omni_speech=True)
    text = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # The talker stops after 2 codes while the thinker still writes: the text is whole.
    out, = llm.generate(as_prompt(*CASES[0]), text, voice="Ethan",
                        talker_params=SamplingParams(temperature=0, max_tokens=2))
    assert len(out.token_ids) == MAX_TOKENS and len(out.codec_token_ids) == 2 and out.audio.size > 0
    # One token of text: the talker hears its prompt, then the text's end, then pads.
    out, = llm.generate(as_prompt(*CASES[0]), SamplingParams(temperature=0, max_tokens=1), voice="Ethan",
                        talker_params=SamplingParams(temperature=0, max_tokens=5))
    assert len(out.token_ids) == 1 and 0 < len(out.codec_token_ids) <= 5
    # Nothing is left behind in either engine.
    assert not llm.engine.has_unfinished_requests and not llm._speech.answers and not llm._speech.streams
    assert llm._speech.talker.stats().kv_blocks_used == 0


def test_a_refused_answer_queues_nothing(tiny_omni):
    llm = LLM(str(tiny_omni), quantization="none", omni_speech=True)
    with pytest.raises(ValueError, match="unknown voice"):
        llm.generate(["one", "two"], SamplingParams(max_tokens=2), voice="Nobody")
    assert not llm.engine.has_unfinished_requests
    assert llm.generate("text alone still works", SamplingParams(max_tokens=2))[0].token_ids


def test_rows_out_of_order_or_an_answer_ended_before_its_prompt_are_refused(tiny_omni):
    # What the talker process does with the decoder's messages: a chunk that does not continue
    # the stream is an error, never rows at the wrong positions; an answer whose text ended
    # before its prompt's rows were all in (aborted before its first token) has nothing to say
    # and leaves nothing behind.
    llm = LLM(str(tiny_omni), quantization="none", omni_speech=True)
    llm.generate("warm", SamplingParams(max_tokens=1), voice="Chelsie")
    stage = llm._speech.stage
    width = llm._speech.spec.text_pad.shape[0]
    stage.add("a", TalkerPrompt(cut=6, kept=[(0, 6)]), "Chelsie", stage.default_params(8))
    stage.receive("a", 0, torch.zeros(3, width))
    with pytest.raises(ValueError, match="from position 4"):
        stage.receive("a", 4, torch.zeros(2, width))
    dropped = stage.receive("a", 3, torch.zeros(2, width), ended=True)
    assert dropped is not None and dropped.error is None
    assert not stage.answers and not stage.streams and stage.talker.stats().kv_blocks_used == 0


def test_streamed_speech_is_the_answer_s_codes_through_the_streaming_codec(tiny_omni):
    from engine.adapters.qwen2_5_omni_codec_stream import CodecStream

    llm = LLM(str(tiny_omni), quantization="none", omni_speech=True)
    # Text longer than the codes the codec's first chunk needs (16 in the tiny codec).
    text = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    # Sampled, seeded, never at its end codes: MAX_CODES codes, several chunks.
    talker = SamplingParams(temperature=0.9, max_tokens=MAX_CODES, seed=5,
                            logit_bias={CODEC_PAD: -100.0, CODEC_EOS: -100.0})
    whole, = llm.generate(as_prompt(*CASES[0]), text, voice="Chelsie", talker_params=talker)
    # (An output is read as it comes: the engine updates a request's output in place.)
    events = [(out.new_text, out.new_audio) for out in llm.stream(as_prompt(*CASES[0]), text, voice="Chelsie",
                                                                   talker_params=talker)]
    chunks = [audio for _, audio in events if audio is not None]
    assert "".join(new_text for new_text, _ in events) == whole.text
    # Streamed as the codec makes it: several chunks, the first before the text is done.
    assert len(chunks) >= 2
    first_audio = next(i for i, (_, audio) in enumerate(events) if audio is not None)
    assert first_audio < max(i for i, (new_text, _) in enumerate(events) if new_text)
    stage = llm._speech.stage
    codec = CodecStream(stage.codec, stage.spec.speakers["Chelsie"], seed=5)
    expected = np.concatenate([*(c.numpy() for c in codec.feed(whole.codec_token_ids)), codec.finish().numpy()])
    np.testing.assert_allclose(np.concatenate(chunks), expected, rtol=1e-5, atol=1e-6)
    assert not llm._speech.answers and llm._speech.talker.stats().kv_blocks_used == 0

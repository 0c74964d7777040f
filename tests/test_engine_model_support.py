"""Models whose attention needs what the engine does not compute are refused at load, naming
the feature and the model type; logit transformations are the model's own, so families that
softcap or scale their logits give transformers' tokens and log-probabilities."""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.reference import hf_greedy, hf_logprobs
from tests.tiny_models import save_tiny_checkpoint
from workers.paged_attention import PagedAttentionMetadata, UnsupportedAttentionFeature, paged_attention

PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(40, 73)), [300, 2, 17]]


@pytest.mark.parametrize("arch,config,features", [
    ("gemma2", {"sliding_window": 16}, ["gemma2 models", "sliding-window attention (window 16",
                                        "attention logit softcapping (attn_logit_softcapping=50.0)"]),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0},
     ["qwen2 models", "sliding-window attention (window 16"]),
    ("mistral", {"sliding_window": 16}, ["mistral models", "sliding-window attention (window 16"]),
    # The window never slides within 512 positions; the sinks are what is missing.
    ("gpt_oss", {"sliding_window": 4096}, ["gpt_oss models", "attention sinks"]),
], ids=["gemma2-softcap-and-window", "qwen2-sliding-window", "mistral-sliding-window", "gpt_oss-sinks"])
def test_model_needing_an_unsupported_attention_feature_is_refused_at_load(tmp_path, arch, config, features):
    path = save_tiny_checkpoint(arch, tmp_path / arch, **config)
    with pytest.raises(ValueError) as refused:
        LLM(str(path), num_kv_blocks=16)
    for feature in features:
        assert feature in str(refused.value)


@pytest.fixture(scope="module", params=[
    ("gemma2", {"attn_logit_softcapping": None, "final_logit_softcapping": 5.0}),
    ("granite", {"logits_scaling": 4.0}),
    # A window as long as the model's context never slides: served, and the attention gets it.
    ("mistral", {"sliding_window": 512}),
], ids=["gemma2-final-softcap", "granite-logits-scaling", "mistral-window-covers-context"])
def supported(request, tmp_path_factory):
    arch, config = request.param
    return save_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch) / arch, **config)


def test_supported_logit_transform_matches_transformers_tokens_and_logprobs(supported):
    llm = LLM(str(supported), num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert out.token_ids == hf_greedy(supported, prompt, 8)
        # Greedy cannot tell a softcap or a scale apart (both keep the argmax); log-probabilities can.
        expected = hf_logprobs(supported, prompt + out.token_ids, len(prompt))
        got = torch.tensor([lp.sampled_logprob for lp in out.logprobs])
        want = expected[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_sliding_window_no_shorter_than_max_model_len_is_served(tmp_path):
    path = save_tiny_checkpoint("qwen2", tmp_path / "qwen2", use_sliding_window=True, sliding_window=16,
                                max_window_layers=0)
    llm = LLM(str(path), num_kv_blocks=16, max_model_len=16)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    # Capped to what the context leaves after the prompt.
    assert out.token_ids == hf_greedy(path, PROMPTS[0], 10) and out.finish_reason == "length"


class _Layer(torch.nn.Module):
    layer_idx = 0


@pytest.mark.parametrize("kwargs,feature", [
    ({"sliding_window": 4}, "sliding-window attention"),
    ({"softcap": 50.0}, "softcapping"),
    ({"s_aux": torch.zeros(4)}, "attention sinks"),
])
def test_attention_refuses_features_the_loader_missed(kwargs, feature):
    tokens, heads, dim = 6, 4, 16
    q = k = v = torch.randn(1, heads, tokens, dim)
    cache = torch.zeros(32, heads, dim)
    meta = PagedAttentionMetadata(torch.arange(tokens), [], [], [(cache, cache.clone())], max_context_len=tokens)
    with pytest.raises(UnsupportedAttentionFeature, match=feature):
        paged_attention(_Layer(), q, k, v, None, scaling=0.25, antiphon_attn=meta, **kwargs)
    # A window covering every context in the step masks nothing: computed as plain attention.
    out, _ = paged_attention(_Layer(), q, k, v, None, scaling=0.25, antiphon_attn=meta, sliding_window=tokens)
    assert out.shape == (1, tokens, heads, dim)


def test_the_forward_context_is_per_thread():
    """Two engines in one process, each stepping in its own thread (asynchronous scheduling),
    must not see each other's step metadata or row layout."""
    import threading

    from workers.cpu.row_layout import StepRows
    from workers.forward_context import get_forward_context, set_forward_context
    from workers.paged_attention import attend

    heads, dim = 2, 4
    seen = {}
    barrier = threading.Barrier(2)

    def run(tokens: int) -> None:
        cache = torch.zeros(32, heads, dim)
        meta = PagedAttentionMetadata(torch.arange(tokens), [], [], [(cache, cache.clone())], max_context_len=tokens)
        with set_forward_context(meta, StepRows(tokens, 1)):
            barrier.wait()  # both threads inside their blocks at once
            q = torch.randn(tokens, heads, dim)
            seen[tokens] = (attend(None, 0, q, q, q, 0.5, None).shape[0], get_forward_context().rows.tokens)

    threads = [threading.Thread(target=run, args=(n,)) for n in (3, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {3: (3, 3), 5: (5, 5)}

"""Reference outputs from transformers itself, for parity tests."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig


@functools.cache
def load_reference_model(path: Path):
    # eager: the one attention every family implements (Gemma2's softcapping has no sdpa path).
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    # Generate every requested token unless told otherwise, like the engine's ignore_eos.
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(path: Path, prompt_token_ids: list[int], max_new_tokens: int, stop_at_eos: bool = False) -> list[int]:
    """Greedy tokens from transformers' generate: every requested token, like the engine's
    ignore_eos, or with stop_at_eos up to the checkpoint's own generation_config EOS ids."""
    model = load_reference_model(path)
    eos_token_id = GenerationConfig.from_pretrained(path).eos_token_id if stop_at_eos else None
    input_ids = torch.tensor([prompt_token_ids])
    # An explicit mask: otherwise generate() treats prompt tokens equal to the pad id as padding.
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=eos_token_id)
    return out[0, len(prompt_token_ids):].tolist()


def hf_logprobs(path: Path, token_ids: list[int], num_prompt_tokens: int) -> torch.Tensor:
    """Log-probabilities transformers gives each token after the prompt, [len - prompt, vocab]."""
    model = load_reference_model(path)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, num_prompt_tokens - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)

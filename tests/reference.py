"""Reference outputs from transformers itself, for parity tests."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


@functools.cache
def load_reference_model(path: Path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    # Generate every requested token, like the engine's ignore_eos.
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(path: Path, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    model = load_reference_model(path)
    input_ids = torch.tensor([prompt_token_ids])
    # An explicit mask: otherwise generate() treats prompt tokens equal to the pad id as padding.
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                         do_sample=False)
    return out[0, len(prompt_token_ids):].tolist()

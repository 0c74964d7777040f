"""What the paged KV cache holds (--kv-cache-dtype).

"auto" is the model's dtype: float32 on CPU, which exact mode's greedy parity with
transformers needs. "bfloat16" on a float32 CPU model halves the cache's bytes: a memory
budget holds twice the tokens, and where the native decode attention serves (models whose
layers run native products: the default model in the default mode) a decode step reads half
the bytes from the cache, widened back to float32 in registers, exactly. Measured there
(README, "CPU speed"): 16-row steps of 14.3-15.2 ms against 16.5-16.8, one-row steps alike,
perplexity 27.08 against 27.03. It is not the default because the default model's answers
sit on near ties that its rounding tips: the README's first question, asked a second time
over the Realtime socket (its prompt then mostly from the prefix cache), was answered
"L'Étoile, la Marseillaise, la femme au martyre, ..." on and on with bfloat16 keys and
"The capital of France is Paris." with float32 ones.

A dtype other than the model's is served on CPU by the torch attention only: the cache
writes round the step's keys and values (rows.to(cache dtype), or decode_stack.cpp's same
rounding), every reader widens what it reads, and a prompt chunk attends to its own keys as
they will be cached (workers/paged_attention.py); the Triton kernels take the model's dtype.
Where torch's SDPA attends (bf16 and int8 modes) it costs a widening copy of every context.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("antiphon")


def resolve_kv_cache_dtype(setting: str, model_dtype: torch.dtype, device: torch.device,
                           attention_backend: str) -> torch.dtype:
    """The cache's dtype for `setting`; refuses one this device and backend do not serve.
    Needs no weights: the executor asks before loading them. `attention_backend` resolved
    ("torch" or "triton": workers/paged_attention.py)."""
    if setting == "auto":
        return model_dtype
    dtype = getattr(torch, setting)
    if dtype == model_dtype:
        return dtype
    if device.type != "cpu" or attention_backend != "torch":
        raise ValueError(f"--kv-cache-dtype {setting} with a {name(model_dtype)} model is served by the torch "
                         "attention on CPU only; elsewhere the cache holds the model's dtype (auto)")
    if dtype != torch.float32:  # a float32 cache holds any model's values exactly
        logger.warning("KV cache in %s for a %s model: keys and values are rounded when cached, so greedy answers "
                       "may differ from transformers'", setting, name(model_dtype))
    return dtype


def name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")

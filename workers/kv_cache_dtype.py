"""What the paged KV cache holds (--kv-cache-dtype).

"auto" gives bfloat16 to a CPU model whose layers run the native 4-bit product (the default
model in the default mode): a decode step reads every row's whole context from the cache,
and with 16 streams that reading was about a third of the step, waiting on memory; bfloat16
halves its bytes (the native decode attention widens them back to float32 in registers,
exactly) and a memory budget holds twice the tokens. Such a model's answers are approximate
already (its weights are 4-bit); the README's perplexity table gives each mode's cost with
its cache dtype. Every other model keeps its own dtype: exact mode's greedy parity with
transformers needs float32 keys and values, and bf16 or int8 models keep torch's attention.

float16 (8 times bfloat16's precision, a range to 65504) is there on request. Any other
dtype than the model's is served on CPU only, where the cache writes round the
step's keys and values (rows.to(cache dtype), or decode_stack.cpp's same rounding) and the
torch attention paths widen what they read; the Triton kernels take the model's dtype.
"""

from __future__ import annotations

import logging

import torch

from workers import cpu_decode_attention, cpu_int4

logger = logging.getLogger("antiphon")


def resolve_kv_cache_dtype(setting: str, model: torch.nn.Module, model_dtype: torch.dtype, device: torch.device,
                           head_dim: int, attention_backend: str) -> torch.dtype:
    """`attention_backend` resolved ("torch" or "triton": workers/paged_attention.py)."""
    if setting == "auto":
        if device.type == "cpu" and attention_backend == "torch" and model_dtype == torch.float32 and \
                runs_native_int4(model) and cpu_decode_attention.serves(model, head_dim):
            return torch.bfloat16
        return model_dtype
    dtype = getattr(torch, setting)
    if dtype != model_dtype:
        if device.type != "cpu" or attention_backend != "torch":
            raise ValueError(f"--kv-cache-dtype {setting} with a {str(model_dtype).removeprefix('torch.')} model "
                             "is served by the torch attention on CPU only; elsewhere the cache holds the model's "
                             "dtype (auto)")
        logger.warning("KV cache in %s for a %s model: keys and values are rounded when cached, so greedy answers "
                       "may differ from transformers'", setting, str(model_dtype).removeprefix("torch."))
    return dtype


def runs_native_int4(model: torch.nn.Module) -> bool:
    """Whether any of `model`'s layers run the native 4-bit product (int4_product.cpp)."""
    return any(isinstance(module, cpu_int4.Int4Linear) and module.int4.native for module in model.modules())

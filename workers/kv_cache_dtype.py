"""What the paged KV cache holds (--kv-cache-dtype).

"auto" gives bfloat16 to a CPU model whose layers run the native 4-bit product (the default
model in the default mode): a decode step reads every row's whole context from the cache, and
with 16 streams that reading waits on memory (README, "CPU speed": 7-8 ms of a 23.5-25 ms
16-row step in float32); bfloat16 halves its bytes (the native decode attention widens them
back to float32 in registers, exactly) and a memory budget holds twice the tokens. Such a
model's numbers are approximate already (8-bit or bfloat16 activations); the README gives
each mode's perplexity with its cache dtype. Every other model keeps its own dtype: exact
mode's greedy parity with transformers needs float32 keys and values, and bf16 or int8
models keep torch's attention, where a 16-bit cache would cost a widening copy of every
context per layer instead of saving reads.

A dtype other than the model's is served on CPU by the torch attention only: the cache
writes round the step's keys and values (rows.to(cache dtype), or decode_stack.cpp's same
rounding) and the readers widen what they read; the Triton kernels take the model's dtype.
"""

from __future__ import annotations

import logging

import torch

from workers import cpu_decode_attention, native_decode

logger = logging.getLogger("antiphon")


def check_kv_cache_dtype(setting: str, model_dtype: torch.dtype, device: torch.device,
                         attention_backend: str) -> None:
    """Refuses, before the model loads, a setting this device and backend do not serve.
    `attention_backend` resolved ("torch" or "triton": workers/paged_attention.py)."""
    if setting == "auto" or getattr(torch, setting) == model_dtype:
        return
    if device.type != "cpu" or attention_backend != "torch":
        raise ValueError(f"--kv-cache-dtype {setting} with a {_name(model_dtype)} model is served by the torch "
                         "attention on CPU only; elsewhere the cache holds the model's dtype (auto)")


def resolve_kv_cache_dtype(setting: str, model: torch.nn.Module, model_dtype: torch.dtype, device: torch.device,
                           head_dim: int, attention_backend: str) -> torch.dtype:
    check_kv_cache_dtype(setting, model_dtype, device, attention_backend)
    if setting == "auto":
        if device.type == "cpu" and attention_backend == "torch" and model_dtype == torch.float32 and \
                native_decode.runs_native_int4(model) and cpu_decode_attention.serves(model, head_dim):
            return torch.bfloat16
        return model_dtype
    dtype = getattr(torch, setting)
    if dtype != model_dtype:
        logger.warning("KV cache in %s for a %s model: keys and values are rounded when cached, so greedy answers "
                       "may differ from transformers'", setting, _name(model_dtype))
    return dtype


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

"""Loads a checkpoint's weights onto a device, with the engine's paged attention plugged in.

Finding the folder and reading its tokenizer and EOS ids belong to engine/checkpoint.py,
which the frontend uses too.
"""

from __future__ import annotations

from pathlib import Path

import logging

import torch

from workers.cpu import native_library
from workers.cpu.linear_modes import can_pack_bf16, cpu_has_native_bf16, prepare_linear_layers, resolve_quantization
from workers.cpu.output_layer import RescoredOutputLayer
from workers.cpu.rms_norm import fuse_rms_norms
from workers.model_support import check_config_supported, check_model_supported
from workers.paged_attention import ATTENTION_NAME

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, model_config, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        checkpoint = getattr(model_config, "dtype", None) or torch.float32
        return getattr(torch, checkpoint) if isinstance(checkpoint, str) else checkpoint
    return getattr(torch, dtype)


def choose_native_parts(model: torch.nn.Module) -> None:
    """The norms and the output layer's rescoring of a float32 CPU model: native where its
    layers are (native_library.takes_native_kernels) and the CPU has AVX-512F (on an AVX2 CPU
    the rescoring stays torch's), else torch's; once, for its lifetime."""
    native = native_library.takes_native_kernels(model)
    fuse_rms_norms(model, native=native and native_library.rms_norm_available())
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(output, RescoredOutputLayer):
        output.native_rescore = native and native_library.rescore_top_available()


def load_model(path: Path, model_config, dtype: torch.dtype, device: torch.device,
               max_model_len: int, adapter=None, quantization: str = "none") -> torch.nn.Module:
    """Refuses models needing features the engine lacks (before reading weights), then loads.
    A multimodal family loads through its adapter: the language model without the tower.
    On CPU the linear layers are then made fast in the `quantization` mode (linear_modes.py)."""
    from transformers import AutoModelForCausalLM

    check_config_supported(model_config, max_model_len)
    mode = resolve_quantization(quantization, device, dtype)
    if adapter is not None:
        model = adapter.load_language_model(dtype, device, ATTENTION_NAME)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, config=model_config, dtype=dtype,
                                                     attn_implementation=ATTENTION_NAME)
    check_model_supported(model)
    model = model.to(device).eval()
    if device.type == "cpu" and dtype == torch.float32:
        # auto: a layer whose weights are already 4-bit is served 4-bit (its codes lose nothing).
        counts = prepare_linear_layers(model, mode, int4_where_exact=quantization == "auto")
        choose_native_parts(model)
        if mode in ("bf16", "int4") and can_pack_bf16() and not cpu_has_native_bf16():
            logger.warning("--quantization %s on a CPU without native bfloat16 (AVX512-BF16 or AMX): its bfloat16 "
                           "products are emulated, likely slower than --quantization none", mode)
        logger.info("CPU linear layers (--quantization %s%s): %s", quantization,
                    f" -> {mode}{', 4-bit where the weights are' if 'int4' in counts else ''}"
                    if quantization == "auto" else "",
                    ", ".join(f"{count} {kind}" for kind, count in counts.items()) or "unchanged")
    return model

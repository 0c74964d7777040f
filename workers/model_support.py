"""Refuse, at load, models that need what the engine does not compute.

The paged attention computes plain causal softmax attention over the whole context. A
model that expects a sliding window, softcapped attention scores, attention sinks, chunked
attention or ALiBi would run without error and produce wrong tokens; so it is refused with
the feature and the model type named. Logit transformations (final softcapping, logit
scales) are fine: the runner computes logits through the model's own forward.
"""

from __future__ import annotations

import inspect

import torch


def check_config_supported(model_config, max_model_len: int) -> None:
    """Raise ValueError naming every unsupported feature in the model's text config.

    `max_model_len` is the longest context the engine will serve: a sliding window at
    least that long never slides, so it is no obstacle.
    """
    text = model_config.get_text_config()
    features = []
    window = _sliding_window(text)
    if window is not None and window < max_model_len:
        features.append(f"sliding-window attention (window {window} < max_model_len {max_model_len})")
    other_layers = sorted(set(getattr(text, "layer_types", None) or ())
                          - {"full_attention", "sliding_attention"})
    if other_layers:
        features.append(f"layer types {', '.join(other_layers)}")
    if getattr(text, "attn_logit_softcapping", None) is not None:
        features.append(f"attention logit softcapping (attn_logit_softcapping={text.attn_logit_softcapping})")
    if getattr(text, "attention_chunk_size", None) is not None:
        features.append(f"chunked attention (attention_chunk_size={text.attention_chunk_size})")
    if getattr(text, "alibi", False) or getattr(text, "position_embedding_type", None) == "alibi":
        features.append("ALiBi position biases")
    if features:
        _refuse(text.model_type, features)


def check_model_supported(model: torch.nn.Module) -> None:
    """What only the built modules show: attention sinks, and a head the runner can drive."""
    features = []
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()):
        features.append("attention sinks")
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        features.append("a forward without logits_to_keep (the runner computes logits through it)")
    if features:
        _refuse(model.config.get_text_config().model_type, features)


def _sliding_window(text) -> int | None:
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        # Families with per-layer types slide only on their "sliding_attention" layers.
        return window if "sliding_attention" in layer_types else None
    if getattr(text, "use_sliding_window", True) is False:
        return None
    return window


def _refuse(model_type: str, features: list[str]) -> None:
    raise ValueError(f"{model_type} models use {'; '.join(features)}, which Antiphon does not implement; "
                     "refusing to load rather than generate wrong tokens")

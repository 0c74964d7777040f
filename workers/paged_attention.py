"""Paged attention over a packed batch, plugged into transformers' AttentionInterface.

Every scheduled token of every request runs as one sequence. Each layer first writes the
step's keys and values into the block cache (all of them, before any read, so requests
scheduled in the same step can share freshly registered prefix blocks), then attends:
decodes in a few padded batches, prefill chunks one span at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kernels import paged_attention_backend

ATTENTION_NAME = "antiphon_paged"


@dataclass
class DecodeGroup:
    """Single-token queries whose contexts have similar lengths, padded to the longest."""

    query_index: torch.Tensor  # [B] rows of the packed batch
    context_slots: torch.Tensor  # [B, L] cache slots of each context, padded
    context_mask: torch.Tensor  # [B, 1, 1, L] True where the slot is part of the context


@dataclass
class PrefillSpan:
    """A chunk of several query tokens of one request."""

    query_start: int
    query_end: int
    # None when the chunk starts at position 0: it attends only to itself, causally.
    context_slots: torch.Tensor | None = None
    # [q, ctx] True where query i may see context position j (j <= start + i).
    causal_mask: torch.Tensor | None = None


@dataclass
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each packed token
    decode_groups: list[DecodeGroup]
    prefill_spans: list[PrefillSpan]
    # Per layer: (keys, values), each [num_blocks * block_size, num_kv_heads, head_dim].
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    # The longest context (cached plus new tokens) of any request in the step.
    max_context_len: int


class UnsupportedAttentionFeature(RuntimeError):
    """The model asked for an attention variant this function does not compute."""


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    antiphon_attn: PagedAttentionMetadata | None = None, sliding_window: int | None = None,
                    softcap: float | None = None, s_aux: torch.Tensor | None = None, **kwargs):
    if antiphon_attn is None:
        raise RuntimeError("antiphon_paged attention needs the engine's metadata (antiphon_attn=...)")
    meta = antiphon_attn
    # Loading refuses models that need these (workers/model_support.py); this catches any
    # that slips through rather than computing plain attention in their place. A window
    # no shorter than every context in the step masks nothing, so it computes the same.
    if sliding_window is not None and meta.max_context_len > sliding_window:
        raise UnsupportedAttentionFeature(
            f"sliding-window attention (window {sliding_window}, context {meta.max_context_len})")
    if softcap is not None:
        raise UnsupportedAttentionFeature(f"attention logit softcapping (softcap={softcap})")
    if s_aux is not None:
        raise UnsupportedAttentionFeature("attention sinks (s_aux)")
    key_cache, value_cache = meta.kv_caches[module.layer_idx]
    # [1, H, T, D] -> [T, H, D]
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    key_cache.index_copy_(0, meta.slot_mapping, k)
    value_cache.index_copy_(0, meta.slot_mapping, v)

    backend = paged_attention_backend(q.device)
    out = torch.empty_like(q)
    for group in meta.decode_groups:
        if backend is not None:
            out[group.query_index] = backend.decode(q[group.query_index], key_cache, value_cache,
                                                    group.context_slots, group.context_mask, scaling)
        else:
            out[group.query_index] = decode_attention(q[group.query_index], key_cache[group.context_slots],
                                                      value_cache[group.context_slots], group.context_mask, scaling)
    for span in meta.prefill_spans:
        rows = slice(span.query_start, span.query_end)
        if backend is not None:
            out[rows] = backend.prefill(q[rows], k[rows], v[rows], key_cache, value_cache, span, scaling)
        elif span.context_slots is None:
            out[rows] = prefill_attention(q[rows], k[rows], v[rows], None, scaling)
        else:
            out[rows] = prefill_attention(q[rows], key_cache[span.context_slots],
                                          value_cache[span.context_slots], span.causal_mask, scaling)
    return out.unsqueeze(0), None


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [B, Hq, D]; k, v [B, L, Hkv, D]; mask [B, 1, 1, L] -> [B, Hq, D].

    Grouped-query heads are folded into the query rows of their KV head, so keys and values
    are never repeated.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    q = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = torch.matmul(q, k.permute(0, 2, 3, 1)) * scale  # [B, Hkv, G, L]
    scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.transpose(1, 2))  # [B, Hkv, G, D]
    return out.reshape(batch, num_q_heads, head_dim)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """q [n, Hq, D]; k, v [ctx, Hkv, D]; mask [n, ctx] or None for plain causal -> [n, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


AttentionInterface.register(ATTENTION_NAME, paged_attention)

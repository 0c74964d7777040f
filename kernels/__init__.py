"""Device kernels for paged attention.

The CPU path is plain torch (workers/paged_attention.py). A CUDA backend registers itself
here, and the attention layer asks `paged_attention_backend` before falling back to torch.
"""

from __future__ import annotations

from typing import Protocol

import torch


class PagedAttentionBackend(Protocol):
    def decode(self, query, key_cache, value_cache, context_slots, context_mask, scale): ...

    def prefill(self, query, key, value, key_cache, value_cache, span, scale): ...


_BACKENDS: dict[str, PagedAttentionBackend] = {}


def register_backend(device_type: str, backend: PagedAttentionBackend) -> None:
    _BACKENDS[device_type] = backend


def paged_attention_backend(device: torch.device) -> PagedAttentionBackend | None:
    return _BACKENDS.get(device.type)

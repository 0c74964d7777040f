"""A multimodal item after preprocessing: what the encoder needs to turn it into embeddings.

Made by a model adapter (engine/adapters/) from a decoded image or audio clip, in the
frontend's preprocessing pool or in the offline API; never on the event loop. `mm_hash` names
the content (pixels or samples, their layout, the processor settings that change embeddings,
the model), so the same item sent by many requests is encoded once and shares prefix-cache
blocks.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np


class PlaceholderMismatch(ValueError):
    """The prompt's placeholders and the items given do not pair up."""


@dataclass(frozen=True, eq=False)
class ProcessedItem:
    mm_hash: str
    # How many embeddings the encoder makes of it: the placeholder's length in the prompt.
    num_embeddings: int
    # What the item's tower takes, float32, shaped as the family's processor makes it: an
    # image's pixels (Qwen2-VL: [num_patches, channels * temporal_patch * patch * patch];
    # LLaVA: [3, H, W]), an audio clip's log-mel features ([mel_bins, frames]).
    tower_input: np.ndarray
    # The family's layout of the embeddings (Qwen2-VL: (t, h, w) patches); () if none.
    grid: tuple[int, ...] = ()
    modality: str = "image"


def salted_hash(mm_hash: str, cache_salt: str) -> str:
    """An item's name within one tenant's caches: with a cache salt, the same item sent by two
    tenants is two entries (encoder cache, the front end's mirror of it, prefix-cache keys), so
    neither can learn from the other's hit timing what the other sent."""
    return hashlib.sha256(f"{cache_salt}\0{mm_hash}".encode()).hexdigest()


def salt_items(placeholders: list, items: list[ProcessedItem], cache_salt: str) -> tuple[list, list[ProcessedItem]]:
    """The placeholders and items of one prompt, renamed for `cache_salt`'s tenant."""
    return ([dataclasses.replace(p, mm_hash=salted_hash(p.mm_hash, cache_salt)) for p in placeholders],
            [dataclasses.replace(item, mm_hash=salted_hash(item.mm_hash, cache_salt)) for item in items])

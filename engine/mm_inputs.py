"""A multimodal item after preprocessing: what the encoder needs to turn it into embeddings.

Made by a model adapter (engine/adapters/) from a decoded image, in the frontend's
preprocessing pool or in the offline API; never on the event loop. `mm_hash` names the
content (pixels, size, mode, the processor settings that change embeddings, the model), so
the same image sent by many requests is encoded once and shares prefix-cache blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    mm_hash: str
    # How many embeddings the encoder makes of it: the placeholder's length in the prompt.
    num_embeddings: int
    # What the vision tower takes, float32, shaped as the family's image processor makes it
    # (Qwen2-VL: [num_patches, channels * temporal_patch * patch * patch]; LLaVA: [3, H, W]).
    pixel_values: np.ndarray
    # The family's layout of the embeddings (Qwen2-VL: (t, h, w) patches); () if none.
    grid: tuple[int, ...] = ()
    modality: str = "image"

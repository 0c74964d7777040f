"""Arrays as ZeroMQ frames: a msgpack header gives dtype and shape, the bytes travel as
their own frame (never pickled, never copied into the header).

Pixels are numpy arrays (the frontend has no torch to spare); embeddings are torch tensors,
sent as raw bytes with torch's dtype name, since numpy has no bfloat16.
"""

from __future__ import annotations

import numpy as np

from engine import protocol
from engine.mm_inputs import ProcessedItem


def item_frames(items: list[ProcessedItem], cached: set[str] = frozenset()
                ) -> tuple[list[protocol.ItemHeader], list[memoryview]]:
    """Headers and pixel frames; items in `cached` go as headers alone."""
    headers, frames = [], []
    for item in items:
        if item.mm_hash in cached:
            headers.append(protocol.ItemHeader(item.mm_hash, item.num_embeddings, list(item.grid), item.modality,
                                               "", []))
            continue
        pixels = np.ascontiguousarray(item.tower_input)
        headers.append(protocol.ItemHeader(item.mm_hash, item.num_embeddings, list(item.grid), item.modality,
                                           pixels.dtype.str, list(pixels.shape)))
        frames.append(memoryview(pixels).cast("B"))
    return headers, frames


def items_from_frames(headers: list[protocol.ItemHeader], frames: list) -> list[ProcessedItem]:
    """Raises ValueError if a frame does not match its header."""
    with_pixels = [h for h in headers if h.shape]
    if len(frames) != len(with_pixels):
        raise ValueError(f"{len(with_pixels)} items with pixels but {len(frames)} frames")
    frames = iter(frames)
    items = []
    for header in headers:
        if not header.shape:
            items.append(ProcessedItem(header.mm_hash, header.num_embeddings, None, tuple(header.grid),
                                        header.modality))
            continue
        frame = next(frames)
        try:
            dtype = np.dtype(header.dtype)
        except TypeError:
            raise ValueError(f"item {header.mm_hash[:16]} has an unknown dtype {header.dtype!r}") from None
        if dtype.kind not in "fiu":
            raise ValueError(f"item {header.mm_hash[:16]} has a non-numeric dtype {header.dtype}")
        pixels = np.frombuffer(frame, dtype=dtype).reshape(header.shape)
        items.append(ProcessedItem(header.mm_hash, header.num_embeddings, pixels, tuple(header.grid),
                                    header.modality))
    return items


def tensor_frame(mm_hash: str, tensor) -> tuple[protocol.ItemEmbeddings, memoryview]:
    dtype, shape, frame = tensor_bytes(tensor)
    return protocol.ItemEmbeddings(mm_hash=mm_hash, dtype=dtype, shape=shape), frame


def tensor_bytes(tensor) -> tuple[str, list[int], memoryview]:
    """A tensor's dtype name, shape and raw bytes (on the host), for a header and its frame."""
    import torch

    tensor = tensor.detach().contiguous().cpu()
    raw = tensor.reshape(-1).view(torch.uint8)
    return str(tensor.dtype).removeprefix("torch."), list(tensor.shape), memoryview(raw.numpy()).cast("B")


def tensor_from_frame(header, frame):
    """The tensor a `tensor_bytes` frame holds; `header` has its dtype name and shape."""
    import torch

    dtype = getattr(torch, header.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {header.dtype!r}")
    # One copy into a writable buffer the tensor owns (torch refuses read-only frames).
    return torch.frombuffer(bytearray(frame), dtype=dtype).reshape(header.shape)

"""Content hashes of full KV blocks, chained so a block's hash names its whole prefix.

hash = sha256(msgpack(parent_hash, token_ids, extra_keys)). The extra keys carry, for every
multimodal item overlapping the block, (mm_hash, item start relative to the block start),
and the cache salt on the first block. Identical token ids with a different image or salt
therefore never share KV, while text before an image still can.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from engine.request import Request

_encode = msgspec.msgpack.Encoder().encode


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None) -> bytes:
    payload = _encode((parent_hash, token_ids, extra_keys))
    return hashlib.sha256(payload).digest()


def block_extra_keys(request: Request, start: int, end: int) -> tuple | None:
    keys: list = []
    if start == 0 and request.cache_salt is not None:
        keys.append(("salt", request.cache_salt))
    for item in request.mm_placeholders:
        if item.offset < end and item.offset + item.length > start:
            keys.append((item.mm_hash, item.offset - start))
    return tuple(keys) if keys else None


def extend_block_hashes(request: Request, block_size: int) -> None:
    """Hash every newly completed block of the request (prompt or generated tokens)."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    num_full_blocks = len(tokens) // block_size
    parent = hashes[-1] if hashes else None
    for index in range(len(hashes), num_full_blocks):
        start, end = index * block_size, (index + 1) * block_size
        parent = hash_block(parent, tokens[start:end], block_extra_keys(request, start, end))
        hashes.append(parent)

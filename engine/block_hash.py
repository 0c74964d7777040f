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
    return extra_keys_of(request.mm_placeholders, request.cache_salt, start, end)


def extra_keys_of(placeholders: Sequence, cache_salt: str | None, start: int, end: int) -> tuple | None:
    """The extra keys of the block [start, end): the salt on the first block, and every item
    (anything with mm_hash, offset and length) that overlaps it."""
    keys: list = []
    if start == 0 and cache_salt is not None:
        keys.append(("salt", cache_salt))
    for item in placeholders:
        if item.offset < end and item.offset + item.length > start:
            keys.append((item.mm_hash, item.offset - start))
    return tuple(keys) if keys else None


def prompt_block_hashes(token_ids: Sequence[int], placeholders: Sequence, cache_salt: str | None,
                        block_size: int) -> list[bytes]:
    """The hashes of a prompt's full blocks, as the decoder computes them for its prefix cache
    (the router matches them against the blocks each replica says it holds)."""
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        parent = hash_block(parent, token_ids[start:end], extra_keys_of(placeholders, cache_salt, start, end))
        hashes.append(parent)
    return hashes


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

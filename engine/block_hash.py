"""Content hashes of full KV blocks, chained so a block's hash names its whole prefix.

hash = sha256(msgpack(parent_hash, token_ids, extra_keys)). The extra keys carry, for every
multimodal item overlapping the block, (mm_hash, item start relative to the block start),
and the cache salt on the first block. Identical token ids with a different image or salt
therefore never share KV, while text before an image still can.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import msgspec

from engine.request import Request

_encode = msgspec.msgpack.Encoder().encode


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None) -> bytes:
    payload = _encode((parent_hash, token_ids, extra_keys))
    return hashlib.sha256(payload).digest()


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


def iter_block_hashes(token_ids: Sequence[int], placeholders: Sequence, cache_salt: str | None,
                      block_size: int, first_block: int = 0, parent: bytes | None = None) -> Iterator[bytes]:
    """The hashes of the full blocks of `token_ids` from `first_block` on (`parent`: the hash of
    the block before it), made one at a time: the scheduler extends a request's hashes with
    them, and the data-parallel router stops at the first block no replica holds."""
    for index in range(first_block, len(token_ids) // block_size):
        start, end = index * block_size, (index + 1) * block_size
        parent = hash_block(parent, token_ids[start:end], extra_keys_of(placeholders, cache_salt, start, end))
        yield parent


def prompt_block_hashes(token_ids: Sequence[int], placeholders: Sequence, cache_salt: str | None,
                        block_size: int) -> list[bytes]:
    return list(iter_block_hashes(token_ids, placeholders, cache_salt, block_size))


def extend_block_hashes(request: Request, block_size: int) -> None:
    """Hash every newly completed block of the request (prompt or generated tokens)."""
    hashes = request.block_hashes
    if len(request.all_token_ids) // block_size > len(hashes):
        hashes.extend(iter_block_hashes(request.all_token_ids, request.mm_placeholders, request.cache_salt,
                                        block_size, len(hashes), hashes[-1] if hashes else None))

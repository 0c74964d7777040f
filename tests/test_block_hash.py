"""Block hashes: chained, collision-resistant, and keyed by images and cache salt."""

from engine.block_hash import hash_block
from engine.request import MultiModalPlaceholder
from tests.test_block_pool import make_request


def test_hash_is_deterministic_and_chains_on_the_parent():
    a = hash_block(None, [1, 2, 3, 4], None)
    assert a == hash_block(None, [1, 2, 3, 4], None)
    assert len(a) == 32
    assert hash_block(a, [5, 6, 7, 8], None) != hash_block(None, [5, 6, 7, 8], None)


def test_identical_tokens_with_different_extra_keys_never_collide():
    tokens = [9, 9, 9, 9]
    keys = [None, (("img-a", 0),), (("img-b", 0),), (("img-a", 1),), (("salt", "tenant-1"),)]
    hashes = {hash_block(None, tokens, k) for k in keys}
    assert len(hashes) == len(keys)


def test_same_text_different_image_never_shares_kv():
    tokens = [1, 2, 3, 4] + [7] * 8 + [5, 6, 7, 8]
    image_a = [MultiModalPlaceholder(offset=4, length=8, mm_hash="aaaa")]
    image_b = [MultiModalPlaceholder(offset=4, length=8, mm_hash="bbbb")]
    a = make_request("a", tokens, mm_placeholders=image_a)
    b = make_request("b", tokens, mm_placeholders=image_b)
    # The text before the image is shared; from the image on, nothing is.
    assert a.block_hashes[0] == b.block_hashes[0]
    assert all(x != y for x, y in zip(a.block_hashes[1:], b.block_hashes[1:]))


def test_image_offset_inside_the_block_is_part_of_the_key():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    early = make_request("a", tokens, mm_placeholders=[MultiModalPlaceholder(1, 2, "img")])
    late = make_request("b", tokens, mm_placeholders=[MultiModalPlaceholder(2, 2, "img")])
    assert early.block_hashes[0] != late.block_hashes[0]


def test_cache_salt_separates_tenants_from_the_first_block():
    tokens = list(range(12))
    plain = make_request("a", tokens)
    salted = make_request("b", tokens, cache_salt="tenant-1")
    assert all(x != y for x, y in zip(plain.block_hashes, salted.block_hashes))
    assert make_request("c", tokens, cache_salt="tenant-1").block_hashes == salted.block_hashes


def test_hashes_cover_only_full_blocks_and_extend_incrementally():
    from engine.block_hash import extend_block_hashes
    request = make_request("a", list(range(6)))
    assert len(request.block_hashes) == 1
    first = request.block_hashes[0]
    request.append_output_token(6)
    request.append_output_token(7)
    extend_block_hashes(request, 4)
    assert len(request.block_hashes) == 2 and request.block_hashes[0] is first

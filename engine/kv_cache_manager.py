"""Per-request KV block bookkeeping on top of the block pool, with prefix-cache lookups."""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_pool import BlockPool, KVBlock
from engine.request import Request


@dataclass
class PrefixCacheStats:
    query_tokens: int = 0
    hit_tokens: int = 0

    def record(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.query_tokens += num_query_tokens
        self.hit_tokens += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are already registered in the cache.
        self.num_registered: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and the hit counters; False (nothing changed) while a
        request holds blocks."""
        if not self.pool.reset_prefix_cache():
            return False
        self.stats = PrefixCacheStats()
        return True

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """Longest run of cached blocks at the start of the request's tokens.

        The hit stops short of the last token: the model must compute at least one token to
        produce logits, so a fully cached prompt recomputes its final block.
        """
        if not self.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: list[KVBlock] = ()) -> list[KVBlock] | None:
        """Give the request room for `num_new_tokens` more tokens (after any cached prefix).

        Returns the newly allocated blocks (often none for a decode), or None, changing
        nothing, when the pool cannot supply them.
        """
        request_id = request.request_id
        blocks = self.req_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_blocks[request_id] = []
        total_tokens = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        num_new_blocks = -(-total_tokens // self.block_size) - len(blocks) - len(cached_blocks)
        if num_new_blocks <= 0 and not cached_blocks:
            # The common decode step: the token fits the last block.
            if self.enable_caching and total_tokens % self.block_size == 0:
                self._register_full_blocks(request, blocks, total_tokens)
            return []
        # Reviving a free cached block removes it from the free queue too.
        revived = sum(1 for b in cached_blocks if b.ref_count == 0)
        if num_new_blocks > self.pool.num_free_blocks - revived:
            if not blocks:
                del self.req_blocks[request_id]
            return None
        if cached_blocks:
            self.pool.touch(list(cached_blocks))
            blocks.extend(cached_blocks)
        new_blocks = self.pool.allocate(num_new_blocks) if num_new_blocks > 0 else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._register_full_blocks(request, blocks, total_tokens)
        return new_blocks

    def _register_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # Blocks are registered when scheduled: their KV is written in this step before any
        # attention reads it, so a request scheduled later in the same step may share them.
        start = self.num_registered.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for index in range(start, end):
            self.pool.cache_block(blocks[index], request.block_hashes[index])
        if end > start:
            self.num_registered[request.request_id] = end

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, None)
        self.num_registered.pop(request.request_id, None)
        if blocks:
            # The tail of a chain is the least likely to be shared: evict it first.
            self.pool.free(blocks[::-1])

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_usable_blocks

"""The pool of KV blocks: reference counts, the prefix-cache index and LRU eviction.

A block with ref_count 0 sits in the free queue but keeps its hash, so a later request
with the same prefix can take it back. Allocation pops from the front of the queue (the
least recently freed), evicting the block's hash at that moment.

After `record_events()` the pool also keeps what entered and left its index since the last
`take_events` (a data-parallel replica tells the front end's router, frontend/replica_router.py).
"""

from __future__ import annotations

from collections import OrderedDict

from engine.change_log import ChangeLog


class KVBlock:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


class BlockPool:
    # Block 0 is never handed out: padded attention gathers point at it, so it stays zero.
    NULL_BLOCK_ID = 0

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("a block pool needs at least 2 blocks (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order is eviction order; values are the blocks themselves.
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[bytes, KVBlock] = {}
        # Hashes indexed and evicted since the last take_events; None when not recorded.
        self._changes: ChangeLog[bytes] | None = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self.free_queue)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cache hits, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def allocate(self, count: int) -> list[KVBlock]:
        if count > len(self.free_queue):
            raise RuntimeError(f"asked for {count} KV blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(count):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def free(self, blocks_in_eviction_order: list[KVBlock]) -> None:
        """Drop one reference on each block; blocks that reach zero join the queue's tail
        in the given order, so the first given is the first evicted."""
        for block in blocks_in_eviction_order:
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        # An identical block computed concurrently by another request keeps the index entry;
        # this one stays private and is simply not findable.
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self._changes is not None:
            self._changes.added(block_hash)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self._changes is not None:
                    self._changes.removed(block.block_hash)
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self._changes is not None:
            self._changes.clear()
        return True

    def record_events(self) -> None:
        """From now on, keep what enters and leaves the index. The first report says `cleared`:
        whoever hears it forgets what an earlier process in this place held."""
        if self._changes is None:
            self._changes = ChangeLog()
            self._changes.clear()

    def take_events(self) -> tuple[list[bytes], list[bytes], bool] | None:
        """(stored, evicted, cleared) since the last call, netted per hash (engine/change_log.py),
        or None when nothing changed (or events are not recorded)."""
        if not self._changes:
            return None
        return self._changes.take()

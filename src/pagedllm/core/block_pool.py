"""The pool of KV-cache blocks: reference counts, an LRU free list, and the prefix cache."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # set while the block holds a full, hashed block of tokens (it may then be reused)
    block_hash: bytes | None = None


class BlockPool:
    """Blocks are in use (ref_cnt > 0), cached (free but holding a known prefix) or free.

    Cached and free blocks share one LRU queue: allocation takes from its front, evicting the
    cached prefix a block held; freed blocks go to its back.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take, cached ones included."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock] | None:
        """Take `n` blocks (ref_cnt 1), or None if there are not enough."""
        if n > len(self._free_queue):
            return None
        out = []
        for _ in range(n):
            block_id, _ = self._free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Share blocks found in the prefix cache with one more request."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference to each block; unreferenced ones join the back of the LRU queue
        in the order given (pass a request's blocks tail first: its tail is evicted first)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = None

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Make a full block findable by its hash. A block already cached under the hash
        (computed concurrently by another request) wins; this one stays unhashed."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()

    def check_integrity(self) -> None:
        """free + cached + in-use == total, and the queue, hashes and ref counts agree."""
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        idle = [b for b in self.blocks if b.ref_cnt == 0]
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        assert {b.block_id for b in idle} == set(self._free_queue), "free queue out of sync"
        cached_idle = [b for b in idle if b.block_hash is not None]
        free = len(idle) - len(cached_idle)
        assert free + len(cached_idle) + len(in_use) == self.num_blocks
        hashed = {b.block_hash: b for b in self.blocks if b.block_hash is not None}
        assert len(hashed) == len(self._cached), "two blocks share a hash"
        assert all(self._cached.get(h) is b for h, b in hashed.items()), "cache map out of sync"

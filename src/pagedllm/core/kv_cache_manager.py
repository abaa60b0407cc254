"""Per-request block tables on top of the block pool, with prefix-cache lookups."""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Sequence

from pagedllm.core.block_pool import BlockPool, KVBlock
from pagedllm.request import Request


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained block hash: a block's key covers every token before it. A cryptographic hash,
    so one user's prompt cannot be crafted to collide with another's cached prefix."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # how many leading blocks of each request are registered in the prefix cache
        self._num_hashed: dict[str, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest cached prefix of a request's tokens, in whole blocks. At least one token
        is always left to compute: its logits give the next token."""
        if not self.enable_caching:
            return []
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (not every attempt of a request that waits)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached: Sequence[KVBlock] = ()
    ) -> bool:
        """Give the request room for `num_new_tokens` more tokens after its computed ones (and
        after `cached`, prefix blocks found for it). False, changing nothing, if blocks are
        short: the caller preempts or waits."""
        blocks = self.req_blocks.get(request.request_id, [])
        num_total = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        num_needed = self.num_blocks_for(num_total) - len(blocks) - len(cached)
        # cached blocks nobody uses sit in the free queue: touching them takes them out of it
        num_idle_hits = sum(1 for b in cached if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_idle_hits:
            return False
        self.req_blocks[request.request_id] = blocks
        self.pool.touch(cached)
        blocks.extend(cached)
        if num_needed > 0:
            new_blocks = self.pool.allocate(num_needed)
            assert new_blocks is not None
            blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_total // self.block_size)
        return True

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_hashed.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_full: int) -> None:
        # NOTE: a block is registered when it is scheduled to be filled, before the step runs;
        # a request admitted in the same step may hit it, which is safe because every layer
        # writes the whole batch's new keys/values before any attention reads them.
        start = self._num_hashed.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_hashes(request)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_hashed[request.request_id] = num_full

    def _update_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i else b""
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))

    def check_integrity(self) -> None:
        """The pool is consistent and every reference is held by a live block table."""
        self.pool.check_integrity()
        refs = Counter(b.block_id for blocks in self.req_blocks.values() for b in blocks)
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but "
                f"{refs.get(block.block_id, 0)} block tables hold it"
            )

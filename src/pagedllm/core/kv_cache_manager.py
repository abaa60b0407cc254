"""Per-request block tables on top of the block pool, with prefix-cache lookups; for a model
whose every layer has a sliding window, the leading blocks no later query reads are freed."""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Sequence

from pagedllm.core.block_pool import BlockPool, KVBlock
from pagedllm.core.state_pool import StateSlots
from pagedllm.request import Request

# NOTE: what a freed (out-of-window) entry of a block table reads as. Any valid block index
# does: the kernels compute slots from the table but never use keys outside the window (the
# C++ and Triton kernels start at the window; the torch reference gathers whole tables and
# masks), and new tokens always land in blocks the request holds. Block 0 may belong to
# another request; the runner pads tables with it too.
NULL_BLOCK_ID = 0


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained block hash: a block's key covers every token before it. A cryptographic hash,
    so one user's prompt cannot be crafted to collide with another's cached prefix."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class KVCacheManager:
    """`sliding_window`: the widest window when EVERY layer has one (None: some layer attends
    globally, or dropping is off). One block table serves all layers, so a block may be freed
    only when no layer will read it again; with any global layer nothing is freed (per-layer-
    group tables, as vLLM's hybrid allocator keeps, would be the next step)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        sliding_window: int | None = None,
        num_state_slots: int | None = None,
    ) -> None:
        self.block_size = block_size
        # a hybrid model's linear-attention state slots, held with the blocks (state_pool.py)
        self.states = StateSlots(num_state_slots) if num_state_slots else None
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_caching)
        # the blocks each request holds: its block table after the dropped entries
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # how many leading entries of a request's block table are dropped (freed: out of the
        # window of every query it has left); they read as NULL_BLOCK_ID
        self._num_dropped: dict[str, int] = {}
        # how many leading blocks of each request are registered in the prefix cache
        self._num_hashed: dict[str, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached
        self.num_window_freed = 0  # block-table entries released by the window
        self.peak_used_blocks = 0  # the most blocks in use right after an allocation
        # (source, destination) block copies of copy-on-write, for the next step to make
        # before its forward pass (taken by the scheduler with `take_copies`)
        self.pending_copies: list[tuple[int, int]] = []

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_out_of_window(self, first_pos: int) -> int:
        """Leading blocks that no query at `first_pos` or later reads. A query at p reads keys
        (p - window, p]: block i (positions [i * bs, (i + 1) * bs)) is dead once its last
        position (i + 1) * bs - 1 <= first_pos - window."""
        if self.sliding_window is None:
            return 0
        return max(0, first_pos - self.sliding_window + 1) // self.block_size

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request with `num_tokens` KV entries holds at once: all of them;
        with a window, at most those a chunk of `max_chunk` tokens reads and writes (the
        window before its first token, the chunk, and one block of misalignment)."""
        all_blocks = self.num_blocks_for(num_tokens)
        if self.sliding_window is None:
            return all_blocks
        return min(all_blocks, self.num_blocks_for(self.sliding_window - 1 + max_chunk) + 1)

    def num_dropped(self, request_id: str) -> int:
        return self._num_dropped.get(request_id, 0)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table: dropped entries read as NULL_BLOCK_ID."""
        held = [b.block_id for b in self.req_blocks.get(request_id, ())]
        return [NULL_BLOCK_ID] * self.num_dropped(request_id) + held

    def get_computed_blocks(self, request: Request) -> list[KVBlock | None]:
        """The longest cached prefix of a request's tokens, in whole blocks. At least one token
        is always left to compute: its logits give the next token. With a window only the
        blocks the window still reads must be cached (a block's hash covers every token before
        it); the leading ones it does not read are None (they may have been evicted)."""
        if not self.enable_caching:
            return []
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        found: list[KVBlock | None] = []
        best = 0  # the longest hit: blocks [num_out_of_window(best * bs), best) cached
        run = 0  # cached blocks in a row, ending at the last one found
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None and self.sliding_window is None:
                break
            found.append(block)
            run = run + 1 if block is not None else 0
            k = len(found)
            if run >= k - self.num_out_of_window(k * self.block_size):
                best = k
        skip = self.num_out_of_window(best * self.block_size)
        return [None] * skip + found[skip:best]

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (not every attempt of a request that waits)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        cached: Sequence[KVBlock | None] = (),
        num_lookahead: int = 0,
    ) -> bool:
        """Give the request room for `num_new_tokens` more tokens after its computed ones (and
        after `cached`, prefix blocks found for a request that holds none). First the blocks
        out of the window of its next query are freed (always safe: no later query reads
        them), and hits out of it are not taken. False, changing nothing else, if blocks are
        short: the caller preempts or waits. `num_lookahead`: room for that many draft tokens
        after the new ones too (speculative decoding); their blocks are never registered in the
        prefix cache by this call."""
        rid = request.request_id
        if self.states is not None and not self.states.can_take(rid):
            return False  # no state slot free: the request waits
        first = request.num_computed_tokens + len(cached) * self.block_size
        num_total = first + num_new_tokens
        num_out = self.num_out_of_window(first)
        blocks = self.req_blocks.get(rid)
        if blocks is not None:  # running: it holds blocks and looks up no hits
            assert not cached, "prefix hits for a request that holds blocks"
            self._drop(rid, blocks, num_out)
            num_dropped = self.num_dropped(rid)
        else:
            num_dropped, blocks = num_out, []
        # a beam's next token lands in a partly filled block another beam holds: copy it
        cow = self._shared_tail(request) if blocks else None
        hits = list(cached[num_out:])
        assert all(b is not None for b in hits), "a hit the window reads is not cached"
        taken = [b for b in hits if b is not None]
        num_slots = num_total + num_lookahead
        num_needed = self.num_blocks_for(num_slots) - num_dropped - len(blocks) - len(taken)
        num_copies = 1 if cow is not None else 0
        # cached blocks nobody uses sit in the free queue: touching them takes them out of it
        num_idle_hits = sum(1 for b in taken if b.ref_cnt == 0)
        if num_needed + num_copies > self.pool.num_free_blocks - num_idle_hits:
            return False
        if cow is not None:
            self._copy_on_write(blocks, cow)
        self.req_blocks[rid] = blocks
        if num_dropped:
            self._num_dropped[rid] = num_dropped
        self.pool.touch(taken)
        blocks.extend(taken)
        if num_needed > 0:
            new_blocks = self.pool.allocate(num_needed)
            assert new_blocks is not None
            blocks.extend(new_blocks)
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_total // self.block_size)
        if self.states is not None:
            self.states.take(rid)
        return True

    def trim(self, request: Request) -> None:
        """Free the request's blocks past the one its next token lands in (those that held
        only a rejected draft's slots: never registered in the prefix cache)."""
        blocks = self.req_blocks.get(request.request_id)
        keep = self.num_blocks_for(request.num_tokens) - self.num_dropped(request.request_id)
        if blocks is not None and len(blocks) > keep:
            self.pool.free(reversed(blocks[keep:]))
            del blocks[keep:]

    def fork(self, parent: Request, child: Request) -> None:
        """`child` (a beam forked from `parent`) shares all of the parent's blocks."""
        blocks = self.req_blocks[parent.request_id]
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = list(blocks)
        for table in (self._num_dropped, self._num_hashed):
            if parent.request_id in table:
                table[child.request_id] = table[parent.request_id]

    def _shared_tail(self, request: Request) -> KVBlock | None:
        """The partly filled block the request's next token lands in, if another holds it."""
        first = request.num_computed_tokens
        if first % self.block_size == 0:
            return None
        blocks = self.req_blocks.get(request.request_id, [])
        i = first // self.block_size - self.num_dropped(request.request_id)
        if 0 <= i < len(blocks) and blocks[i].ref_cnt > 1:
            return blocks[i]
        return None

    def _copy_on_write(self, blocks: list[KVBlock], shared: KVBlock) -> None:
        new_blocks = self.pool.allocate(1)
        assert new_blocks is not None
        blocks[blocks.index(shared)] = new_blocks[0]
        self.pending_copies.append((shared.block_id, new_blocks[0].block_id))
        self.pool.free([shared])

    def num_blocks_needed(self, plan: Sequence[tuple[Request, int]]) -> int:
        """Free blocks that `allocate_slots` of each running (request, new tokens) would take,
        in this order: a shared partly filled block is copied by all but its last writer."""
        need = 0
        writers: Counter[int] = Counter()
        for request, num_new in plan:
            rid = request.request_id
            held = self.num_dropped(rid) + len(self.req_blocks.get(rid, ()))
            need += max(0, self.num_blocks_for(request.num_computed_tokens + num_new) - held)
            if num_new and (shared := self._shared_tail(request)) is not None:
                writers[shared.block_id] += 1
        for block_id, n in writers.items():
            need += min(n, self.pool.blocks[block_id].ref_cnt - 1)
        return need

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _drop(self, request_id: str, blocks: list[KVBlock], num_out: int) -> None:
        """Free a running request's leading blocks up to table entry `num_out`; its table
        keeps its length (the entries read as NULL_BLOCK_ID). Freed blocks keep their hashes
        in the prefix cache until they are evicted: their KV stays valid for other requests."""
        n = num_out - self.num_dropped(request_id)
        if n <= 0:
            return
        self.pool.free(blocks[:n])
        del blocks[:n]
        self._num_dropped[request_id] = num_out
        self.num_window_freed += n

    def state_slot(self, request_id: str) -> int:
        """The request's linear-attention state slot; -1 on a model without them."""
        return -1 if self.states is None else self.states.slot(request_id)

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_hashed.pop(request.request_id, None)
        self._num_dropped.pop(request.request_id, None)
        self.pool.free(reversed(blocks))
        if self.states is not None:
            self.states.release(request.request_id)

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_full: int) -> None:
        # NOTE: a block is registered when it is scheduled to be filled, before the step runs;
        # a request admitted in the same step may hit it, which is safe because every layer
        # writes the whole batch's new keys/values before any attention reads them. A block is
        # dropped only after the step that filled it (it was registered then).
        dropped = self.num_dropped(request.request_id)
        start = max(self._num_hashed.get(request.request_id, 0), dropped)
        if num_full <= start:
            return
        self._update_hashes(request)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i - dropped], request.block_hashes[i])
        self._num_hashed[request.request_id] = num_full

    def _update_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            lora = request.lora_request  # an adapter's KV is its own
            parent = hashes[i - 1] if i else (b"" if lora is None else lora.cache_salt)
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
        assert self._num_dropped.keys() <= self.req_blocks.keys(), "a dropped table is gone"
        assert self.sliding_window is not None or not self._num_dropped, "dropped, no window"
        if self.states is not None:
            self.states.check_integrity()
            assert self.states.holders() <= self.req_blocks.keys(), "a state slot outlives blocks"

"""Model-free tests of the block pool (ref counts, LRU free queue, prefix cache) and of the KV
cache manager on top of it (block tables, chained-hash prefix hits)."""

from __future__ import annotations

import pytest

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_manager import KVCacheManager, hash_block
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 4  # block size of the KV cache manager tests


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def create_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(temperature=0, max_tokens=None))


def create_manager(num_blocks: int = 16, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_caching)


def admit(kv: KVCacheManager, request: Request) -> list:
    """What the scheduler does on admission: look up the prefix, allocate the rest."""
    cached = kv.get_computed_blocks(request)
    num_cached = len(cached) * BS
    assert kv.allocate_slots(request, request.num_tokens - num_cached, cached)
    request.num_computed_tokens = request.num_tokens
    return cached


# --- BlockPool -------------------------------------------------------------------------------


def test_allocate_and_free_ref_counts() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert blocks is not None
    assert ids(blocks) == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 3)
    assert pool.usage() == pytest.approx(0.75)

    pool.touch(blocks[:1])  # shared with a second request
    assert blocks[0].ref_cnt == 2
    assert pool.num_free_blocks == 1
    pool.free(blocks)
    assert [b.ref_cnt for b in blocks] == [1, 0, 0]
    assert pool.num_free_blocks == 3
    pool.check_integrity()

    pool.free(blocks[:1])
    assert blocks[0].ref_cnt == 0
    assert pool.num_free_blocks == 4
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_allocate_returns_none_when_short_and_changes_nothing() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert a is not None
    pool.cache_block(a[0], b"h0")
    pool.free(a)  # queue: 2 3 0(cached h0) 1
    before = [(b.ref_cnt, b.block_hash) for b in pool.blocks]

    assert pool.allocate(5) is None
    assert [(b.ref_cnt, b.block_hash) for b in pool.blocks] == before
    assert pool.num_free_blocks == 4
    assert pool.get_cached_block(b"h0") is a[0]
    # the LRU order is untouched too
    assert ids(pool.allocate(4)) == [2, 3, 0, 1]
    pool.check_integrity()


def test_freed_blocks_go_to_the_back_of_the_lru_queue() -> None:
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    assert blocks is not None
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    # never-used blocks 3, 4 first, then in the order freed
    assert ids(pool.allocate(4)) == [3, 4, 2, 0]
    pool.check_integrity()


def test_reallocating_a_cached_block_evicts_its_hash() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1) or []
    pool.cache_block(block, b"h")
    assert pool.get_cached_block(b"h") is block
    pool.free([block])
    # free but still findable: a cached block
    assert (pool.num_free_blocks, pool.num_cached_blocks) == (2, 1)
    assert pool.get_cached_block(b"h") is block
    pool.check_integrity()

    first = pool.allocate(1)
    assert first is not None and first[0] is not block  # block 1 was ahead in the queue
    assert pool.get_cached_block(b"h") is block
    again = pool.allocate(1)
    assert again == [block]
    assert block.block_hash is None
    assert pool.get_cached_block(b"h") is None
    assert pool.num_cached_blocks == 0
    pool.check_integrity()


def test_touch_of_an_idle_cached_block_takes_it_out_of_the_free_queue() -> None:
    pool = BlockPool(3)
    (block,) = pool.allocate(1) or []
    pool.cache_block(block, b"h")
    pool.free([block])
    assert pool.num_free_blocks == 3

    pool.touch([block])
    assert block.ref_cnt == 1
    assert pool.num_free_blocks == 2
    pool.check_integrity()
    others = pool.allocate(2)
    assert others is not None and block not in others
    assert pool.allocate(1) is None
    assert block.block_hash == b"h"  # still cached, and in use

    pool.free([block])
    assert pool.num_free_blocks == 1
    pool.check_integrity()


def test_double_free_asserts() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    assert blocks is not None
    pool.free(blocks)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(blocks)


def test_cache_block_first_wins_and_disabled_caching_caches_nothing() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2) or []
    pool.cache_block(a, b"h")
    pool.cache_block(b, b"h")  # the same content computed by another request
    assert pool.get_cached_block(b"h") is a
    assert b.block_hash is None
    pool.cache_block(a, b"other")  # a block keeps its first hash
    assert a.block_hash == b"h" and pool.get_cached_block(b"other") is None
    pool.check_integrity()

    pool.reset_prefix_cache()
    assert a.block_hash is None and pool.num_cached_blocks == 0
    pool.check_integrity()

    off = BlockPool(2, enable_caching=False)
    (block,) = off.allocate(1) or []
    off.cache_block(block, b"h")
    assert off.get_cached_block(b"h") is None and block.block_hash is None


def _zero_ref_of_used(pool: BlockPool) -> None:
    pool.blocks[0].ref_cnt = 0


def _ref_on_free(pool: BlockPool) -> None:
    pool.blocks[3].ref_cnt = 1


def _negative_ref(pool: BlockPool) -> None:
    pool.blocks[3].ref_cnt = -1


def _stray_hash(pool: BlockPool) -> None:
    pool.blocks[3].block_hash = b"not in the cache map"


def _two_blocks_one_hash(pool: BlockPool) -> None:
    pool.blocks[3].block_hash = pool.blocks[0].block_hash


def _cache_map_points_elsewhere(pool: BlockPool) -> None:
    pool._cached[b"h0"] = pool.blocks[1]


@pytest.mark.parametrize(
    "tamper",
    [
        _zero_ref_of_used,
        _ref_on_free,
        _negative_ref,
        _stray_hash,
        _two_blocks_one_hash,
        _cache_map_points_elsewhere,
    ],
)
def test_check_integrity_catches_corruption(tamper) -> None:
    pool = BlockPool(4)
    used = pool.allocate(2)
    assert used is not None
    pool.cache_block(used[0], b"h0")
    pool.check_integrity()
    tamper(pool)
    with pytest.raises(AssertionError):
        pool.check_integrity()


# --- KVCacheManager --------------------------------------------------------------------------


def test_blocks_are_allocated_only_at_block_boundaries() -> None:
    kv = create_manager(num_blocks=4)
    request = create_request("r", [10])
    num_blocks = []
    for token in range(11, 11 + 2 * BS):
        # compute the last known token, then "sample" the next one
        assert kv.allocate_slots(request, request.num_tokens - request.num_computed_tokens)
        request.num_computed_tokens = request.num_tokens
        num_blocks.append(len(kv.block_ids("r")))
        request.append_output_token(token)
        kv.check_integrity()
    # tokens 1..4 fit one block, the 5th opens the second, the 9th the third
    assert num_blocks == [1, 1, 1, 1, 2, 2, 2, 2]
    assert kv.pool.num_free_blocks == 2
    kv.free(request)
    assert kv.pool.num_free_blocks == 4
    kv.check_integrity()


def test_allocate_slots_fails_without_change_when_short() -> None:
    kv = create_manager(num_blocks=2)
    request = create_request("r", list(range(9)))  # needs 3 blocks
    assert not kv.allocate_slots(request, 9)
    assert kv.block_ids("r") == [] and "r" not in kv.req_blocks
    assert kv.pool.num_free_blocks == 2
    assert kv.allocate_slots(request, 8)
    assert len(kv.block_ids("r")) == 2
    kv.check_integrity()


def test_prefix_hit_on_same_leading_blocks() -> None:
    kv = create_manager()
    a = create_request("a", list(range(12)))
    admit(kv, a)
    a_blocks = kv.req_blocks["a"]
    # the same first two blocks, then a different third one
    b = create_request("b", [*range(8), 90, 91, 92, 93, 94])
    hits = kv.get_computed_blocks(b)
    assert hits == a_blocks[:2]
    assert kv.allocate_slots(b, b.num_tokens - 8, hits)
    assert kv.req_blocks["b"][:2] == a_blocks[:2]
    assert [blk.ref_cnt for blk in a_blocks] == [2, 2, 1]
    kv.check_integrity()

    kv.free(a)
    assert [blk.ref_cnt for blk in a_blocks] == [1, 1, 0]
    kv.free(b)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert kv.pool.num_cached_blocks == 3 + 1  # a's three blocks and b's third one
    kv.check_integrity()


def test_no_prefix_hit_when_an_earlier_block_differs() -> None:
    kv = create_manager()
    a = create_request("a", list(range(12)))
    admit(kv, a)
    # blocks 2 and 3 hold the same tokens as a's, but block 1 differs: the chain breaks
    b = create_request("b", [50, 51, 52, 53, *range(4, 12), 99])
    assert kv.get_computed_blocks(b) == []
    # and a hit stops at the first miss
    c = create_request("c", [*range(4), 50, 51, 52, 53, *range(8, 12), 99])
    assert kv.get_computed_blocks(c) == kv.req_blocks["a"][:1]


@pytest.mark.parametrize(("extra", "num_hits"), [(0, 2), (1, 3)])
def test_at_least_one_token_is_left_to_compute(extra: int, num_hits: int) -> None:
    kv = create_manager()
    admit(kv, create_request("a", list(range(12))))
    # exactly 3 cached blocks: only 2 may hit, the last token's logits are needed
    b = create_request("b", list(range(12 + extra)))
    hits = kv.get_computed_blocks(b)
    assert hits == kv.req_blocks["a"][:num_hits]
    assert b.num_tokens - len(hits) * BS >= 1


def test_prefix_hit_statistics() -> None:
    kv = create_manager()
    admit(kv, create_request("a", list(range(10))))  # blocks 1, 2 full and cached
    # lookups alone count nothing: the scheduler records the lookup of an admitted request
    assert (kv.prefix_queries, kv.prefix_hits) == (0, 0)
    hits = kv.get_computed_blocks(create_request("b", [*range(8), 70, 71, 72]))
    assert len(hits) == 2 and (kv.prefix_queries, kv.prefix_hits) == (0, 0)
    kv.record_prefix_lookup(11, 8)
    assert (kv.prefix_queries, kv.prefix_hits) == (11, 8)


def test_no_hits_when_caching_is_disabled() -> None:
    kv = create_manager(enable_caching=False)
    admit(kv, create_request("a", list(range(12))))
    assert kv.pool.num_cached_blocks == 0
    assert all(blk.block_hash is None for blk in kv.pool.blocks)
    assert kv.get_computed_blocks(create_request("b", list(range(13)))) == []
    assert kv.prefix_hits == 0
    kv.check_integrity()


def test_hash_block_chains_over_every_earlier_token() -> None:
    h1 = hash_block(b"", [1, 2, 3, 4])
    assert h1 == hash_block(b"", [1, 2, 3, 4])
    assert len(h1) == 16
    assert h1 != hash_block(b"", [1, 2, 3, 5])
    assert h1 != hash_block(b"", [4, 3, 2, 1])
    h2 = hash_block(h1, [5, 6, 7, 8])
    assert h2 != hash_block(b"", [5, 6, 7, 8])
    assert h2 != hash_block(hash_block(b"", [0, 2, 3, 4]), [5, 6, 7, 8])
    # token ids above 2**32 are not truncated
    assert hash_block(b"", [1]) != hash_block(b"", [1 + 2**32])

    kv = create_manager()
    request = create_request("r", list(range(1, 11)))
    kv.get_computed_blocks(request)
    assert request.block_hashes == [
        hash_block(b"", [1, 2, 3, 4]),
        hash_block(hash_block(b"", [1, 2, 3, 4]), [5, 6, 7, 8]),
    ]


def test_an_idle_hit_counts_against_the_free_blocks() -> None:
    kv = create_manager(num_blocks=3)
    a = create_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    assert (kv.pool.num_free_blocks, kv.pool.num_cached_blocks) == (3, 2)

    # 16 tokens: 2 idle hits + 2 new blocks, but only 1 block is neither
    big = create_request("big", [*range(8), *range(80, 88)])
    hits = kv.get_computed_blocks(big)
    assert len(hits) == 2
    assert not kv.allocate_slots(big, 8, hits)
    assert (kv.pool.num_free_blocks, kv.pool.num_cached_blocks) == (3, 2)
    assert all(blk.ref_cnt == 0 for blk in hits)
    kv.check_integrity()

    # 12 tokens: 2 idle hits + 1 new block fit exactly
    b = create_request("b", [*range(8), 80, 81, 82, 83])
    hits = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 4, hits)
    assert kv.pool.num_free_blocks == 0
    assert kv.pool.num_cached_blocks == 3
    kv.check_integrity()


def test_a_freed_request_is_evicted_tail_first() -> None:
    kv = create_manager(num_blocks=3)
    a = create_request("a", list(range(12)))
    admit(kv, a)
    tail = kv.req_blocks["a"][-1]
    kv.free(a)
    assert kv.pool.num_cached_blocks == 3

    (taken,) = kv.pool.allocate(1) or []
    assert taken is tail
    assert kv.pool.num_cached_blocks == 2
    # the head of a's prefix survives
    b = create_request("b", list(range(13)))
    assert len(kv.get_computed_blocks(b)) == 2
    kv.pool.free([taken])
    kv.check_integrity()


def test_blocks_are_cached_only_once_full() -> None:
    kv = create_manager()
    request = create_request("r", list(range(6)))
    assert kv.allocate_slots(request, 6)
    request.num_computed_tokens = 6
    assert kv.pool.num_cached_blocks == 1  # the second block holds 2 of 4 tokens
    request.append_output_token(6)
    request.append_output_token(7)
    assert kv.allocate_slots(request, 2)
    assert kv.pool.num_cached_blocks == 2
    assert kv.req_blocks["r"][1].block_hash == hash_block(request.block_hashes[0], [4, 5, 6, 7])
    kv.check_integrity()

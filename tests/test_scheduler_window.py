"""Model-free scheduler tests of a model whose every layer has a sliding window: a request's
blocks are freed as they fall out of the window (tests/scheduler_steps.py checks at every
step that exactly the blocks before its chunk's window are freed), admission and preemption
count only the blocks held, prefix hits need only the blocks the window reads, and nothing
leaks."""

from __future__ import annotations

import itertools
import random

import pytest
from scheduler_steps import (
    BS,
    add,
    assert_idle,
    create_requests,
    create_scheduler,
    expected_output,
    run,
    step,
)

from pagedllm.core.kv_cache_manager import NULL_BLOCK_ID
from pagedllm.request import Request, RequestStatus

# a query at p reads keys (p - 8, p]: at most 3 blocks of BS = 4 (2 when aligned)
W = 8


def test_the_bound_of_what_the_window_frees() -> None:
    sched = create_scheduler(sliding_window=W)
    kv = sched.kv
    # the query at 7 reads keys 0..7; at 12 keys 5..12 (block 0 dead); at 16 keys 9..16
    assert [kv.num_out_of_window(p) for p in (0, 7, 11, 12, 15, 16, 19, 20)] == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        3,
    ]
    # a chunk of 8 after a window of 7: 15 positions over at most 5 blocks
    assert kv.max_blocks_held(1000, 8) == 5
    assert kv.max_blocks_held(12, 8) == 3  # never more than the request's own blocks
    assert create_scheduler().kv.max_blocks_held(1000, 8) == 250


@pytest.mark.parametrize("caching", [False, True])
def test_decoding_frees_the_blocks_that_fall_out_of_the_window(caching: bool) -> None:
    sched = create_scheduler(sliding_window=W, enable_prefix_caching=caching)
    (r,) = create_requests(1, prompt_len=6, max_tokens=40, ignore_eos=True)
    add(sched, [r])
    used = []
    while sched.has_unfinished():
        step(sched)
        if r.status == RequestStatus.RUNNING:
            used.append(sched.kv.pool.num_used_blocks)
            # freed blocks keep their KV and hashes in the prefix cache until evicted
            dropped = sched.kv.num_dropped("r0")
            assert sched.kv.pool.num_cached_blocks >= (dropped if caching else 0)
    # positions 0..44 computed (the 46th token is sampled, never fed back): 12 blocks, of
    # which the decode at 44 (reading 37..44) held only blocks 9..11
    assert max(used) == 3
    assert sched.kv.num_window_freed == 44 // BS - 2 == 9
    assert sched.kv.peak_used_blocks == 3
    assert sched.kv.pool.num_cached_blocks == (45 // BS if caching else 0)
    assert r.output_token_ids == expected_output("r0", 40)
    assert_idle(sched)

    plain = create_scheduler(enable_prefix_caching=caching)
    add(plain, create_requests(1, prompt_len=6, max_tokens=40, ignore_eos=True))
    run(plain)
    assert (plain.kv.peak_used_blocks, plain.kv.num_window_freed) == (12, 0)
    assert_idle(plain)


def test_the_block_table_keeps_its_length_and_indices() -> None:
    sched = create_scheduler(sliding_window=W)
    (r,) = create_requests(1, prompt_len=6, max_tokens=20, ignore_eos=True)
    add(sched, [r])
    first_ids = step(sched)[0].scheduled[0].block_ids
    for _ in range(14):
        out, _ = step(sched)
    (s,) = out.scheduled
    assert s.start_pos == 6 + 14 - 1
    # the query at 19 reads 12..19: blocks 0..2 are freed, their entries read as block 0
    assert s.block_ids[:3] == [NULL_BLOCK_ID] * 3
    assert len(s.block_ids) == 5 and s.block_ids[3] not in first_ids
    assert [b.block_id for b in sched.kv.req_blocks["r0"]] == s.block_ids[3:]
    run(sched)
    assert_idle(sched)


def test_a_pool_smaller_than_one_request_serves_several() -> None:
    knobs = dict(num_blocks=8, max_num_batched_tokens=8)
    (big,) = create_requests(1, prompt_len=6, max_tokens=40, ignore_eos=True)
    with pytest.raises(ValueError, match="needs 12 KV blocks; the pool has 8"):
        create_scheduler(**knobs).add_request(big)
    sched = create_scheduler(sliding_window=W, **knobs)
    requests = create_requests(3, prompt_len=6, max_tokens=40, ignore_eos=True)
    add(sched, requests)
    outs = run(sched)
    assert max(len(o.scheduled) for o in outs) == 3
    for r in requests:
        assert r.output_token_ids == expected_output(r.request_id, 40)
    assert_idle(sched)


@pytest.mark.parametrize("caching", [False, True])
def test_the_window_saves_preemptions(caching: bool) -> None:
    preemptions = {}
    for window in (None, W):
        sched = create_scheduler(
            num_blocks=16, sliding_window=window, enable_prefix_caching=caching
        )
        requests = create_requests(4, prompt_len=6, max_tokens=40, ignore_eos=True)
        add(sched, requests)
        run(sched)
        for r in requests:
            assert r.output_token_ids == expected_output(r.request_id, 40)
        assert_idle(sched)
        preemptions[window] = sched.num_preemptions
    # 4 requests of 12 blocks each in 16 blocks, or of at most 3 each
    assert preemptions[W] == 0 < preemptions[None]


@pytest.mark.parametrize("caching", [False, True])
def test_random_workload_with_preemption_under_the_window(caching: bool) -> None:
    # requests of up to 60 tokens, some sharing a 24-token prefix, in 9 blocks: preempted
    # while holding dropped entries, recomputed (from hits past the window when caching),
    # aborted; step() checks every chunk's dropped entries
    rng = random.Random(0)
    sched = create_scheduler(
        num_blocks=9,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        sliding_window=W,
        enable_prefix_caching=caching,
    )
    shared = [7000 + j for j in range(24)]
    requests: list[Request] = []
    preempted_with_drops = resumed_with_drops = 0
    for i in itertools.count():
        if i >= 30 and not sched.has_unfinished():
            break
        if i < 30 and i % 2 == 0:
            prompt_len = rng.randint(1, 30)
            (r,) = create_requests(
                1,
                prompt_len=prompt_len,
                max_tokens=rng.randint(1, 30),
                first=i,
                prefix=shared[: min(prompt_len, rng.choice([0, 12, 24]))],
                ignore_eos=True,
            )
            sched.add_request(r)
            requests.append(r)
        if i % 9 == 4 and sched.running:
            sched.abort(rng.choice(sched.running).request_id)
        held = {rid for rid in sched.kv.req_blocks if sched.kv.num_dropped(rid)}
        out, _ = step(sched)
        preempted_with_drops += len(held & set(out.preempted_ids))
        resumed = [s for s in out.scheduled if s.request_id in out.resumed_ids]
        # (step() checked that these entries are dropped)
        resumed_with_drops += sum(s.start_pos - W + 1 >= BS for s in resumed)
    assert preempted_with_drops > 0
    assert (resumed_with_drops > 0) == caching
    assert (sched.kv.prefix_hits > 0) == caching
    aborted = [r for r in requests if r.status == RequestStatus.FINISHED_ABORTED]
    assert 0 < len(aborted) < len(requests)
    for r in requests:
        n = r.sampling_params.max_tokens
        assert n is not None
        if r.status != RequestStatus.FINISHED_ABORTED:
            assert r.output_token_ids == expected_output(r.request_id, n)
    assert_idle(sched)


def test_a_hit_needs_only_the_blocks_its_window_reads() -> None:
    # r0 drops its first blocks early: they go to the free queue first and are evicted first
    sched = create_scheduler(num_blocks=8, max_num_batched_tokens=8, sliding_window=W)
    (r0,) = create_requests(1, prompt_len=24, max_tokens=2, ignore_eos=True)
    add(sched, [r0])
    run(sched)
    (r1,) = create_requests(1, prompt_len=8, max_tokens=1, first=1)
    add(sched, [r1])
    run(sched)  # takes two blocks: one never used, and r0's block 0
    assert sched.kv.pool.get_cached_block(r0.block_hashes[0]) is None
    assert sched.kv.pool.get_cached_block(r0.block_hashes[1]) is not None

    # the same prompt: its chain of hashes breaks at block 0, but a chunk from position 20
    # reads keys 13..: blocks 3 and 4 (cached) are all it needs
    (r2,) = create_requests(1, prompt_len=24, max_tokens=2, ignore_eos=True)
    r2.request_id = "r2"
    add(sched, [r2])
    out, _ = step(sched)
    (s,) = out.scheduled
    assert (s.start_pos, r2.num_cached_tokens) == (20, 20)
    assert s.block_ids[:3] == [NULL_BLOCK_ID] * 3
    run(sched)
    assert_idle(sched)


def test_abort_and_roll_back_free_what_a_windowed_request_holds() -> None:
    sched = create_scheduler(sliding_window=W)
    r0, r1 = create_requests(2, prompt_len=6, max_tokens=30, ignore_eos=True)
    add(sched, [r0, r1])
    for _ in range(12):
        out, _ = step(sched)
    assert sched.kv.num_dropped("r0") > 0
    sched.abort("r0")
    sched.check_integrity()
    out = sched.schedule()  # r1 only; its step "fails"
    assert sched.kv.num_dropped("r1") > 0
    assert sched.roll_back(out) == [r1]
    assert sched.kv.num_dropped("r1") == 0 and not sched.kv.req_blocks
    sched.check_integrity()
    run(sched)
    assert r1.output_token_ids == expected_output("r1", 30)
    assert_idle(sched)

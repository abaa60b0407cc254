"""Model-free scheduler tests (the steps checked by tests/scheduler_steps.py): the token budget,
admission, stopping and preemption; abort, request validation and a random workload in
tests/test_scheduler_requests.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from scheduler_steps import (
    EOS,
    add,
    assert_idle,
    create_requests,
    create_scheduler,
    expected_output,
    layout,
    run,
    step,
)

from pagedllm.request import Request, RequestStatus

# --- the token budget -------------------------------------------------------------------------


def test_chunked_prefill_respects_the_token_budget() -> None:
    sched = create_scheduler(max_num_batched_tokens=16)
    (r,) = create_requests(1, prompt_len=40, max_tokens=3)
    add(sched, [r])

    outs = [step(sched)[0] for _ in range(4)]
    assert [layout(o) for o in outs] == [
        [("r0", 0, 16, False)],
        [("r0", 16, 16, False)],
        [("r0", 32, 8, True)],
        [("r0", 40, 1, True)],
    ]
    # no token sampled before the last chunk; blocks grow with the computed tokens
    assert [len(o.scheduled[0].block_ids) for o in outs] == [4, 8, 10, 11]
    assert r.output_token_ids == expected_output("r0", 2)
    run(sched)
    assert r.output_token_ids == expected_output("r0", 3)
    assert_idle(sched)


def test_the_token_budget_is_shared_by_all_requests() -> None:
    sched = create_scheduler(max_num_batched_tokens=16)
    requests = create_requests(3, prompt_len=10, max_tokens=5)
    add(sched, requests)

    assert layout(step(sched)[0]) == [("r0", 0, 10, True), ("r1", 0, 6, False)]
    assert layout(step(sched)[0]) == [
        ("r0", 10, 1, True),
        ("r1", 6, 4, True),
        ("r2", 0, 10, True),
    ]
    outs = run(sched)
    assert max(o.num_tokens for o in outs) <= 16
    for r in requests:
        assert r.output_token_ids == expected_output(r.request_id, 5)
    assert_idle(sched)


def test_without_chunked_prefill_a_prompt_waits_for_budget_in_fcfs_order() -> None:
    sched = create_scheduler(
        enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=32
    )
    add(sched, create_requests(2, prompt_len=20, max_tokens=3))
    add(sched, create_requests(1, prompt_len=2, max_tokens=3, first=2))

    # r1 does not fit the 12 tokens left and is not chunked; r2 would fit but may not pass it
    assert layout(step(sched)[0]) == [("r0", 0, 20, True)]
    assert [r.request_id for r in sched.waiting] == ["r1", "r2"]
    assert layout(step(sched)[0]) == [
        ("r0", 20, 1, True),
        ("r1", 0, 20, True),
        ("r2", 0, 2, True),
    ]
    run(sched)
    assert_idle(sched)


def test_running_requests_are_scheduled_before_waiting_ones() -> None:
    sched = create_scheduler(max_num_batched_tokens=8)
    add(sched, create_requests(1, prompt_len=4, max_tokens=5))
    step(sched)
    add(sched, create_requests(1, prompt_len=20, max_tokens=2, first=1))

    # r1 arrived with 20 tokens to compute, but r0's decode comes first
    assert layout(step(sched)[0]) == [("r0", 4, 1, True), ("r1", 0, 7, False)]
    assert layout(step(sched)[0]) == [("r0", 5, 1, True), ("r1", 7, 7, False)]
    run(sched)
    assert_idle(sched)


def test_decode_schedules_exactly_one_token_per_running_request() -> None:
    sched = create_scheduler()
    requests = create_requests(3, prompt_len=5, max_tokens=4)
    add(sched, requests)
    assert layout(step(sched)[0]) == [(f"r{i}", 0, 5, True) for i in range(3)]

    for n in range(1, 4):
        last = {r.request_id: r.output_token_ids[-1] for r in requests}
        out, changed = step(sched)
        assert layout(out) == [(f"r{i}", 4 + n, 1, True) for i in range(3)]
        # a decode computes the token sampled last step
        assert all(s.token_ids == [last[s.request_id]] for s in out.scheduled)
        assert changed == requests
    for r in requests:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_output(r.request_id, 4)
    assert_idle(sched)


# --- admission ---------------------------------------------------------------------------------


def test_max_num_seqs_caps_the_running_requests() -> None:
    sched = create_scheduler(max_num_seqs=2)
    add(sched, create_requests(1, prompt_len=4, max_tokens=1))
    add(sched, create_requests(3, prompt_len=4, max_tokens=3, first=1))

    assert [s.request_id for s in step(sched)[0].scheduled] == ["r0", "r1"]
    # r0 finished: one seat for r2, r3 keeps waiting
    assert [s.request_id for s in step(sched)[0].scheduled] == ["r1", "r2"]
    assert [r.request_id for r in sched.waiting] == ["r3"]
    outs = run(sched)
    assert max(len(o.scheduled) for o in outs) == 2
    assert_idle(sched)


def test_fcfs_admission_waits_for_blocks_in_arrival_order() -> None:
    sched = create_scheduler(num_blocks=6, enable_prefix_caching=False)
    add(sched, create_requests(1, prompt_len=16, max_tokens=4))
    add(sched, create_requests(1, prompt_len=12, max_tokens=2, first=1))
    add(sched, create_requests(1, prompt_len=4, max_tokens=2, first=2))

    # r0 takes 4 of 6 blocks; r1 needs 3; r2 needs 1 but must not overtake r1
    first_step: dict[str, int] = {}
    for i, out in enumerate(run(sched)):
        for s in out.scheduled:
            first_step.setdefault(s.request_id, i)
    assert first_step["r0"] == 0
    assert 0 < first_step["r1"] <= first_step["r2"]
    assert sched.num_preemptions == 0
    assert_idle(sched)


def test_prefix_cache_hit_on_admission_skips_the_cached_tokens() -> None:
    sched = create_scheduler()
    (r0,) = create_requests(1, prompt_len=12, max_tokens=3)
    add(sched, [r0])
    (out, _) = step(sched)
    r0_blocks = out.scheduled[0].block_ids
    assert r0.num_cached_tokens == 0

    # r1 shares r0's first two blocks (still in use by r0)
    (r1,) = create_requests(1, prompt_len=11, max_tokens=2, first=1, prefix=r0.prompt_token_ids[:8])
    add(sched, [r1])
    (out, _) = step(sched)
    s1 = out.scheduled[1]
    assert (s1.request_id, s1.start_pos, s1.token_ids) == ("r1", 8, r1.prompt_token_ids[8:])
    assert s1.block_ids[:2] == r0_blocks[:2]
    assert r1.num_cached_tokens == 8
    assert sched.kv.prefix_hits == 8
    run(sched)
    assert_idle(sched)

    # after both finished the blocks stay cached: the same 12-token prompt hits 2 of 3 blocks
    (r2,) = create_requests(1, prompt_len=12, max_tokens=2, first=2, prefix=r0.prompt_token_ids)
    add(sched, [r2])
    (out, _) = step(sched)
    assert layout(out) == [("r2", 8, 4, True)]
    assert out.scheduled[0].block_ids[:2] == r0_blocks[:2]
    assert r2.num_cached_tokens == 8
    run(sched)
    assert r2.output_token_ids == expected_output("r2", 2)
    assert_idle(sched)


def test_no_prefix_hit_when_caching_is_disabled() -> None:
    sched = create_scheduler(enable_prefix_caching=False)
    (r0,) = create_requests(1, prompt_len=12, max_tokens=1)
    add(sched, [r0])
    run(sched)
    (r1,) = create_requests(1, prompt_len=13, max_tokens=1, first=1, prefix=r0.prompt_token_ids)
    add(sched, [r1])
    assert layout(step(sched)[0]) == [("r1", 0, 13, True)]
    assert r1.num_cached_tokens == 0 and sched.kv.prefix_hits == 0
    assert_idle(sched)


# --- stopping ----------------------------------------------------------------------------------


def scripted(tokens: Sequence[int]) -> Callable[[Request], int]:
    return lambda request: tokens[request.num_output_tokens]


STOPPED, LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize(
    ("params", "tokens", "num_out", "status"),
    [
        ({}, [5, 6, EOS, 7, 8], 3, STOPPED),
        ({"ignore_eos": True}, [EOS] * 5, 4, LENGTH),
        ({"stop_token_ids": [9]}, [5, 9, 7, 8, 8], 2, STOPPED),
        ({"stop_token_ids": [9], "ignore_eos": True}, [EOS, 9, 7, 8, 8], 2, STOPPED),
        ({}, [5, 6, 7, 8, 8], 4, LENGTH),
    ],
    ids=["eos", "ignore_eos", "stop_token", "stop_token_with_ignore_eos", "max_tokens"],
)
def test_stop_conditions(params, tokens, num_out, status) -> None:
    sched = create_scheduler()
    (r,) = create_requests(1, prompt_len=6, max_tokens=4, **params)
    add(sched, [r])
    outs = run(sched, sampler=scripted(tokens))
    assert len(outs) == num_out
    assert r.output_token_ids == tokens[:num_out]
    assert r.status == status and r.status.is_finished
    assert r.status.finish_reason == ("stop" if status == STOPPED else "length")
    assert_idle(sched)


def test_stop_at_max_model_len() -> None:
    sched = create_scheduler(max_model_len=16)
    (r,) = create_requests(1, prompt_len=10, max_tokens=None)
    add(sched, [r])
    run(sched)
    assert r.num_tokens == 16
    assert r.output_token_ids == expected_output("r0", 6)
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.status.finish_reason == "length"
    assert_idle(sched)


def test_finished_request_is_reported_in_the_step_it_stops() -> None:
    sched = create_scheduler()
    requests = create_requests(2, prompt_len=4, max_tokens=2)
    add(sched, requests)
    _, changed = step(sched)
    assert changed == requests and not any(r.status.is_finished for r in changed)
    _, changed = step(sched)
    assert changed == requests and all(r.status.is_finished for r in changed)
    assert_idle(sched)


# --- preemption --------------------------------------------------------------------------------


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_of_the_newest_request_and_its_recompute(caching: bool) -> None:
    # 2 requests of 4 + 8 tokens need 3 blocks each; the pool has 5. r2 waits for a seat.
    sched = create_scheduler(num_blocks=5, max_num_seqs=2, enable_prefix_caching=caching)
    r0, r1 = create_requests(2, prompt_len=4, max_tokens=8)
    (r2,) = create_requests(1, prompt_len=2, max_tokens=2, first=2)
    add(sched, [r0, r1, r2])

    for _ in range(5):  # prefill, then decodes at positions 4..7 in two blocks each
        out, _ = step(sched)
        assert not out.preempted_ids
    assert sched.kv.pool.num_free_blocks == 1

    # position 8 needs a third block each: r0 (older) gets the last one, r1 is preempted
    out, changed = step(sched)
    assert out.preempted_ids == ["r1"]
    assert layout(out) == [("r0", 8, 1, True)]
    assert changed == [r0]
    assert r1.status == RequestStatus.PREEMPTED
    assert list(sched.waiting) == [r1, r2] and sched.running == [r0]  # r1 at the front
    assert r1.output_token_ids == expected_output("r1", 5)  # kept
    assert r1.num_computed_tokens == 0 and sched.kv.block_ids("r1") == []
    assert (sched.num_preemptions, r1.num_preemptions, r0.num_preemptions) == (1, 1, 0)

    # r1 is readmitted only when r0 is done; it recomputes prompt + output (cached or not)
    readmitted = None
    while readmitted is None:
        out, _ = step(sched)
        assert not out.preempted_ids
        readmitted = next((s for s in out.scheduled if s.request_id == "r1"), None)
        # r2 does not pass r1 while r1 waits for blocks
        assert [s.request_id for s in out.scheduled if s.request_id != "r0"] in ([], ["r1", "r2"])
    assert r0.status == RequestStatus.FINISHED_LENGTH
    if caching:  # its two full blocks were still cached
        assert readmitted.start_pos == 8
    else:
        assert (readmitted.start_pos, r1.num_cached_tokens) == (0, 0)
    recomputed = r1.prompt_token_ids + expected_output("r1", 5)
    assert readmitted.token_ids == recomputed[readmitted.start_pos :]
    assert readmitted.sample

    run(sched)
    assert r0.output_token_ids == expected_output("r0", 8)
    assert r1.output_token_ids == expected_output("r1", 8)
    assert r1.status == RequestStatus.FINISHED_LENGTH
    assert r2.output_token_ids == expected_output("r2", 2)
    assert sched.num_preemptions == 1
    assert_idle(sched)


def test_a_running_request_preempts_the_newest_other_one() -> None:
    sched = create_scheduler(num_blocks=4, enable_prefix_caching=False)
    (r0,) = create_requests(1, prompt_len=4, max_tokens=8)
    (r1,) = create_requests(1, prompt_len=11, max_tokens=2, first=1)
    add(sched, [r0, r1])
    step(sched)  # r0: 1 block, r1: 3 blocks
    assert sched.kv.pool.num_free_blocks == 0

    # r0 (older) needs a second block: r1 gives up its three
    out, _ = step(sched)
    assert out.preempted_ids == ["r1"]
    assert layout(out) == [("r0", 4, 1, True)]
    assert sched.kv.pool.num_free_blocks == 2
    assert (r0.num_preemptions, r1.num_preemptions) == (0, 1)
    assert r1.output_token_ids == expected_output("r1", 1)

    outs = run(sched)
    first_r1 = next(o for o in outs if any(s.request_id == "r1" for s in o.scheduled))
    assert all(s.request_id != "r0" for s in first_r1.scheduled)  # r0 was done
    assert layout(first_r1)[-1] == ("r1", 0, 12, True)  # prompt + its first output token
    assert r0.output_token_ids == expected_output("r0", 8)
    assert r1.output_token_ids == expected_output("r1", 2)
    assert sched.num_preemptions == 1
    assert_idle(sched)


def test_no_waiting_request_is_admitted_in_a_step_that_preempted() -> None:
    # With a budget of 5 the preempted r1 could come back at once as a 4-token chunk in one
    # of the two blocks it freed: the scheduler must wait for the next step.
    sched = create_scheduler(num_blocks=5, max_num_batched_tokens=5, enable_prefix_caching=False)
    r0, r1 = create_requests(2, prompt_len=4, max_tokens=8)
    add(sched, [r0, r1])
    while True:
        out, _ = step(sched)
        if out.preempted_ids:
            break
    assert out.preempted_ids == ["r1"]
    assert [s.request_id for s in out.scheduled] == ["r0"]
    assert sched.waiting[0] is r1 and r1.status == RequestStatus.PREEMPTED
    assert sched.kv.pool.num_free_blocks == 2
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    run(sched)
    assert r1.output_token_ids == expected_output("r1", 8)
    assert_idle(sched)


def test_num_cached_tokens_never_exceeds_the_prompt_after_preemption() -> None:
    sched = create_scheduler(num_blocks=5)
    r0, r1 = create_requests(2, prompt_len=4, max_tokens=8)
    add(sched, [r0, r1])
    run(sched)
    assert r1.num_preemptions == 1
    assert r1.num_cached_tokens <= r1.num_prompt_tokens


def test_prefix_stats_count_a_request_blocked_for_blocks_once() -> None:
    sched = create_scheduler(num_blocks=4)
    (r0,) = create_requests(1, prompt_len=12, max_tokens=4)  # 3 blocks, then 4
    (r1,) = create_requests(1, prompt_len=8, max_tokens=2, first=1)  # waits for 2 blocks
    add(sched, [r0, r1])
    outs = run(sched)
    assert [s.request_id for s in outs[0].scheduled] == ["r0"]
    assert sched.num_preemptions == 0
    assert sched.kv.prefix_queries == 12 + 8  # r1 counted once, not once per step waited

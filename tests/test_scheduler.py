"""Model-free scheduler tests: the scheduler is driven with hand-made `RunnerOutput`s.

Every step is checked by `step()`: the token budget and sequence cap hold, each scheduled
chunk is the request's own tokens at its positions, its blocks cover them, `sample` is set
exactly on a chunk that reaches the last known token, and the KV pool stays consistent.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

EOS = 2
BS = 4  # block size used by every test


def create_scheduler(
    *,
    num_blocks: int = 64,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
        ),
        CacheConfig(
            block_size=BS, num_kv_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching
        ),
    )


def create_requests(
    n: int,
    prompt_len: int = 8,
    max_tokens: int | None = 4,
    *,
    first: int = 0,
    prefix: Sequence[int] = (),
    ignore_eos: bool = False,
    stop_token_ids: Sequence[int] = (),
) -> list[Request]:
    """Requests r{first}..: distinct prompts (no accidental prefix hits) after `prefix`."""
    requests = []
    for i in range(first, first + n):
        prompt = [*prefix, *(1000 * (i + 1) + j for j in range(prompt_len - len(prefix)))]
        params = SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
            stop_token_ids=list(stop_token_ids),
        )
        requests.append(Request(f"r{i}", prompt, params, eos_token_ids=frozenset({EOS})))
    return requests


def add(sched: Scheduler, requests: Sequence[Request]) -> None:
    for request in requests:
        sched.add_request(request)


def token_for(request: Request) -> int:
    """The default "model": request r{i} generates 500 + 20 i, 500 + 20 i + 1, ..."""
    return 500 + 20 * int(request.request_id[1:]) + request.num_output_tokens


def expected_output(request_id: str, n: int) -> list[int]:
    return [500 + 20 * int(request_id[1:]) + k for k in range(n)]


def step(
    sched: Scheduler, sampler: Callable[[Request], int] = token_for
) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step with a fake runner; checks the step's invariants."""
    out = sched.schedule()
    config = sched.config
    assert out.num_tokens <= config.max_num_batched_tokens
    assert len(out.scheduled) <= config.max_num_seqs
    assert len(out.scheduled) == len({s.request_id for s in out.scheduled})
    assert all(r.status == RequestStatus.RUNNING for r in sched.running)
    sampled = {}
    for s in out.scheduled:
        request = sched.requests[s.request_id]
        assert s.num_tokens > 0
        assert s.token_ids == request.all_token_ids[s.start_pos : s.start_pos + s.num_tokens]
        assert len(s.block_ids) * BS >= s.start_pos + s.num_tokens
        assert s.block_ids == sched.kv.block_ids(s.request_id)
        assert s.sample == (s.start_pos + s.num_tokens == request.num_tokens)
        if s.sample:
            sampled[s.request_id] = sampler(request)
    sched.check_integrity()
    changed = sched.update_from_output(out, RunnerOutput(sampled))
    sched.check_integrity()
    return out, changed


def run(sched: Scheduler, max_steps: int = 500, **kw) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        assert len(outs) < max_steps, "no progress"
        outs.append(step(sched, **kw)[0])
    return outs


def assert_idle(sched: Scheduler) -> None:
    """Everything finished: no request, no block table, every block free."""
    assert not sched.has_unfinished()
    assert not sched.running and not sched.waiting
    assert not sched.kv.req_blocks
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks
    sched.check_integrity()


def layout(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(s.request_id, s.start_pos, s.num_tokens, s.sample) for s in out.scheduled]


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


# --- abort -------------------------------------------------------------------------------------


def test_abort_a_running_request_frees_all_its_blocks() -> None:
    sched = create_scheduler(num_blocks=8, max_num_seqs=1)
    r0, r1 = create_requests(2, prompt_len=20, max_tokens=4)
    add(sched, [r0, r1])
    step(sched)
    assert sched.kv.pool.num_free_blocks == 8 - 5  # 20 computed tokens in 5 blocks

    assert sched.abort("r0") is r0
    assert r0.status == RequestStatus.FINISHED_ABORTED and r0.status.finish_reason == "abort"
    assert sched.kv.pool.num_free_blocks == 8
    assert sched.running == [] and list(sched.waiting) == [r1]
    sched.check_integrity()

    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["r1"]
    assert sched.abort("r1") is r1
    assert_idle(sched)


def test_abort_a_waiting_and_a_preempted_request() -> None:
    sched = create_scheduler(num_blocks=5, enable_prefix_caching=False)
    r0, r1 = create_requests(2, prompt_len=4, max_tokens=8)
    (r2,) = create_requests(1, prompt_len=4, max_tokens=8, first=2)
    add(sched, [r0, r1, r2])
    assert sched.abort("r2") is r2  # never scheduled
    assert r2.status == RequestStatus.FINISHED_ABORTED
    assert r2 not in sched.waiting
    sched.check_integrity()

    while r1.status != RequestStatus.PREEMPTED:
        step(sched)
    assert sched.abort("r1") is r1
    assert r1.status == RequestStatus.FINISHED_ABORTED
    assert not sched.waiting
    sched.check_integrity()
    run(sched)
    assert r0.output_token_ids == expected_output("r0", 8)
    assert_idle(sched)


def test_abort_of_an_unknown_request_returns_none() -> None:
    sched = create_scheduler()
    add(sched, create_requests(1))
    step(sched)
    assert sched.abort("nope") is None
    assert sched.num_running == 1
    run(sched)
    assert sched.abort("r0") is None  # finished already
    assert_idle(sched)


def test_update_ignores_a_request_aborted_after_being_scheduled() -> None:
    sched = create_scheduler()
    r0, r1 = create_requests(2, prompt_len=6, max_tokens=3)
    add(sched, [r0, r1])
    out = sched.schedule()
    sched.abort("r0")
    assert sched.kv.block_ids("r0") == []
    changed = sched.update_from_output(out, RunnerOutput({"r0": 11, "r1": 12}))
    assert changed == [r1]
    assert r0.output_token_ids == [] and r1.output_token_ids == [12]
    assert r0.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.pool.num_used_blocks == 2
    sched.check_integrity()
    run(sched)
    assert_idle(sched)


# --- add_request validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "match"),
    [
        pytest.param(0, 4, "empty", id="empty"),
        pytest.param(32, 1, "context", id="prompt_at_max_model_len"),
        pytest.param(40, 1, "context", id="prompt_beyond_max_model_len"),
        pytest.param(20, 13, "exceeds", id="prompt_plus_max_tokens"),
        pytest.param(16, 10, "pool", id="larger_than_pool"),
        pytest.param(10, None, "pool", id="no_max_tokens_larger_than_pool"),
    ],
)
def test_add_request_rejects(prompt_len: int, max_tokens: int | None, match: str) -> None:
    sched = create_scheduler(num_blocks=6, max_model_len=32, max_num_batched_tokens=32)
    (r,) = create_requests(1, prompt_len=prompt_len, max_tokens=max_tokens)
    with pytest.raises(ValueError, match=match):
        sched.add_request(r)
    assert not sched.has_unfinished() and sched.num_waiting == 0


@pytest.mark.parametrize(("prompt_len", "max_tokens"), [(20, 4), (1, 23), (23, 1)])
def test_add_request_accepts_what_fits(prompt_len: int, max_tokens: int) -> None:
    sched = create_scheduler(num_blocks=6, max_model_len=32, max_num_batched_tokens=32)
    (r,) = create_requests(1, prompt_len=prompt_len, max_tokens=max_tokens)
    sched.add_request(r)
    run(sched)
    assert r.output_token_ids == expected_output("r0", max_tokens)
    assert_idle(sched)


def test_add_request_rejects_a_duplicate_id() -> None:
    sched = create_scheduler()
    (r,) = create_requests(1)
    sched.add_request(r)
    (dup,) = create_requests(1)
    with pytest.raises(ValueError, match="already"):
        sched.add_request(dup)
    assert list(sched.waiting) == [r]
    run(sched)
    assert_idle(sched)


def test_add_request_accepts_a_request_that_exactly_fits_the_pool() -> None:
    # 4 + 4 tokens: KV for positions 0..7 (2 blocks); the 9th token is sampled, never computed
    sched = create_scheduler(num_blocks=2)
    (r,) = create_requests(1, prompt_len=4, max_tokens=5)
    sched.add_request(r)
    run(sched)
    assert r.output_token_ids == expected_output("r0", 5)
    assert_idle(sched)


# --- everything together -------------------------------------------------------------------------


def test_random_workload_keeps_invariants_and_frees_everything() -> None:
    rng = random.Random(0)
    sched = create_scheduler(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=10)
    shared = [7000 + j for j in range(8)]
    requests: list[Request] = []
    eos_at: dict[str, int] = {}  # output index at which the "model" emits EOS

    def sampler(request: Request) -> int:
        n = request.num_output_tokens
        return EOS if n == eos_at[request.request_id] else token_for(request)

    for i in range(30):
        if i % 2 == 0 or i < 6:
            prompt_len = rng.randint(1, 20)
            (r,) = create_requests(
                1,
                prompt_len=prompt_len,
                max_tokens=rng.randint(1, 12),
                first=i,
                prefix=shared[: min(prompt_len, rng.choice([0, 4, 8]))],
            )
            eos_at[r.request_id] = rng.randint(0, 15)
            sched.add_request(r)
            requests.append(r)
        if i % 7 == 3 and sched.running:
            sched.abort(rng.choice(sched.running).request_id)
        step(sched, sampler)
    run(sched, sampler=sampler)

    assert sched.num_preemptions > 0
    assert sched.kv.prefix_hits > 0
    aborted = [r for r in requests if r.status == RequestStatus.FINISHED_ABORTED]
    assert 0 < len(aborted) < len(requests)
    for r in requests:
        if r.status == RequestStatus.FINISHED_ABORTED:
            continue
        max_tokens = r.sampling_params.max_tokens
        assert max_tokens is not None
        eos = eos_at[r.request_id]
        want = expected_output(r.request_id, min(max_tokens, eos + 1))
        if eos < max_tokens:
            want[eos] = EOS
        assert r.output_token_ids == want
        if eos < max_tokens - 1:
            assert r.status == RequestStatus.FINISHED_STOPPED
        elif eos >= max_tokens:
            assert r.status == RequestStatus.FINISHED_LENGTH
        else:  # EOS as the last allowed token: either reason will do
            assert r.status.is_finished
    assert_idle(sched)

"""Model-free scheduler tests (the steps checked by tests/scheduler_steps.py): abort, the
validation of `add_request`, and a random workload of everything together."""

from __future__ import annotations

import random

import pytest
from scheduler_steps import (
    EOS,
    add,
    assert_idle,
    create_requests,
    create_scheduler,
    expected_output,
    run,
    step,
    token_for,
)

from pagedllm.core.scheduler import RunnerOutput
from pagedllm.request import Request, RequestStatus

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

"""The scheduler driven without a model (tests/test_scheduler*.py): hand-made
`RunnerOutput`s, and `step()`, which checks every step: the token budget and sequence cap hold,
each scheduled chunk is the request's own tokens at its positions, its blocks cover them,
`sample` is set exactly on a chunk that reaches the last known token, and the KV pool stays
consistent; with a sliding window, that a request holds every block its chunk reads and no
block before them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
    sliding_window: int | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
        ),
        CacheConfig(
            block_size=BS,
            num_kv_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
            sliding_window=sliding_window,
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
        check_window(sched, s.request_id, s.start_pos)
        assert s.sample == (s.start_pos + s.num_tokens == request.num_tokens)
        if s.sample:
            sampled[s.request_id] = sampler(request)
    sched.check_integrity()
    changed = sched.update_from_output(out, RunnerOutput(sampled))
    sched.check_integrity()
    return out, changed


def check_window(sched: Scheduler, request_id: str, start_pos: int) -> None:
    """The request dropped exactly the blocks before the window of its chunk's first query
    (at `start_pos`, which reads keys (start_pos - window, start_pos]); it holds the rest."""
    kv, window = sched.kv, sched.kv.sliding_window
    num_dropped = kv.num_dropped(request_id)
    if window is None:
        assert num_dropped == 0
        return
    assert num_dropped * BS <= max(0, start_pos - window + 1)  # nothing read is freed
    assert num_dropped == max(0, start_pos - window + 1) // BS  # everything else is
    assert len(kv.req_blocks[request_id]) + num_dropped == len(kv.block_ids(request_id))
    # never more than what admission counts on (Scheduler.check_fits)
    end = len(kv.block_ids(request_id)) * BS
    budget = sched.config.max_num_batched_tokens
    assert len(kv.req_blocks[request_id]) <= kv.max_blocks_held(end, budget)


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

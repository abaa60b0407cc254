"""Speculative decoding, the runner's side: every position of a request's draft is sampled as
a row of its own (with the history the drafts before it make), then the longest run of drafts
those samples agree with is kept, plus the next sample.

Why this is exact: row i is sampled from the target's distribution given the prompt, the
outputs and the drafts d_1..d_i; it is used only when d_1..d_i were all accepted, i.e. equal
what rows 0..i-1 sampled: the same history, hence the same distribution (and under greedy the
same token) as without speculation. An n-gram draft is a point mass q = 1[d]: the standard
rejection rule (accept d with probability min(1, p(d) / q(d)) = p(d), else draw from max(0,
p - q) normalised: p without d) gives every token the law "draw x ~ p; accept d if x == d,
else emit x", which is what this does.

Seeded rows draw one uniform each, in order (`layers.sampler`); afterwards the request's
generator is rewound to one draw per emitted token, so a seeded request emits the same tokens
with and without speculation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from pagedllm.core.scheduler import RunnerOutput, ScheduledRequest
from pagedllm.layers.sampler import SamplerOutput


def verify_rows(batch: Sequence[ScheduledRequest]) -> Iterator[tuple[int, list[int]]]:
    """(index in `batch`, output history) of each row to sample: one per request, and one
    per draft token after it (its history extended by the drafts before it)."""
    for b, s in enumerate(batch):
        yield b, s.output_token_ids
        for i in range(1, len(s.spec_token_ids) + 1):
            yield b, [*s.output_token_ids, *s.spec_token_ids[:i]]


def num_rows(batch: Sequence[ScheduledRequest]) -> int:
    return sum(1 + len(s.spec_token_ids) for s in batch)


def generator_states(
    batch: Sequence[ScheduledRequest], generators: dict[str, torch.Generator]
) -> dict[str, torch.Tensor]:
    """The state of each drafting request's generator before its rows are sampled."""
    return {
        s.request_id: generators[s.request_id].get_state()
        for s in batch
        if s.spec_token_ids and s.request_id in generators
    }


def accept(
    batch: Sequence[ScheduledRequest],
    result: SamplerOutput,
    out: RunnerOutput,
    states: dict[str, torch.Tensor],
    generators: dict[str, torch.Generator],
) -> None:
    """Each request's emitted tokens (and log-probs) from its rows' samples into `out`."""
    r = 0
    for s in batch:
        n = 1 + len(s.spec_token_ids)
        tokens, logprobs = result.token_ids[r : r + n], result.logprobs[r : r + n]
        r += n
        emitted = 1
        while emitted < n and tokens[emitted - 1] == s.spec_token_ids[emitted - 1]:
            emitted += 1
        rid = s.request_id
        out.sampled_token_ids[rid] = tokens[0]
        if logprobs[0] is not None:
            out.logprobs[rid] = logprobs[0]
        if n == 1:
            continue
        out.spec_token_ids[rid] = tokens[1:emitted]
        if logprobs[0] is not None:
            out.spec_logprobs[rid] = [lp for lp in logprobs[1:emitted] if lp is not None]
        if rid in states:
            _rewind(generators[rid], states[rid], emitted)


def _rewind(gen: torch.Generator, before: torch.Tensor, emitted: int) -> None:
    """One draw per emitted token, as without speculation (if the rows drew at all)."""
    if torch.equal(gen.get_state(), before):
        return  # an all-greedy step draws nothing
    gen.set_state(before)
    for _ in range(emitted):
        torch.rand(1, generator=gen, device=gen.device)

"""Speculative decoding with a draft model, the verification of sampled requests: the standard
rejection rule (Leviathan et al. 2023, Chen et al. 2023), which keeps the target's distribution
whatever the draft's.

Row i of a request's verification is the target's distribution p_i at the position of draft
token d_{i+1} (its history extended by d_1..d_i); q_i is the draft's distribution d_{i+1} was
drawn from. For i = 0, 1, ...: accept d_{i+1} with probability min(1, p_i(d) / q_i(d)); at the
first rejection emit a draw from max(0, p_i - q_i) normalised and stop; when all k are
accepted emit a draw from p_k (the bonus token). p is what the sampler would draw from (bans,
logit bias, penalties, temperature, min_p / top-k / top-p, a grammar's mask); greedy requests
do not come here (they keep the longest run of drafts equal to the argmax: spec_verify).

A seeded request draws every uniform of a step (the draft's k, then the k acceptance tests and
the final draw) from a generator seeded by its seed and its output length at the step
(`step_generator`): reproducible, whatever else shares its batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.core.scheduler import RunnerOutput, ScheduledRequest
from pagedllm.layers.sampler import (
    Sampler,
    SampleRequest,
    SamplingMetadata,
    filter_full,
    token_logprobs,
)


@dataclass
class Draft:
    """A sampled request's draft: the draft's distribution at each draft position (k, V),
    and the step's random stream of a seeded request (None: the global one)."""

    probs: torch.Tensor
    generator: torch.Generator | None


def step_generator(
    seed: int | None, num_output_tokens: int, device: torch.device
) -> torch.Generator | None:
    """A seeded request's stream for the step that follows `num_output_tokens` outputs."""
    if seed is None:
        return None
    mixed = (seed * 0x9E3779B97F4A7C15 + num_output_tokens) % (1 << 63)
    return torch.Generator(device).manual_seed(mixed)


def uniforms(n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    return torch.rand(n, generator=generator, device=device)


def sampling_probs(
    logits: torch.Tensor, rows: Sequence[SampleRequest], meta: SamplingMetadata
) -> torch.Tensor:
    """(S, V): the distribution the sampler draws each row's token from; a greedy row's is
    one-hot at its argmax."""
    x = Sampler.adjust(logits, rows, meta)
    onehot = torch.zeros_like(x).scatter_(1, x.argmax(dim=-1, keepdim=True), 1.0)
    if meta.all_greedy:
        return onehot
    assert meta.temperature is not None and meta.greedy is not None
    x = filter_full(x / meta.temperature, meta, torch.arange(x.shape[0], device=x.device))
    return torch.where(meta.greedy[:, None], onehot, x.softmax(dim=-1))


def draw(probs: torch.Tensor, u: torch.Tensor) -> list[int]:
    """One token per row of `probs` (S, V) by inverse CDF with the row's uniform `u` (S,)."""
    cdf = probs.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    return idx[:, 0].clamp(max=probs.shape[1] - 1).tolist()


def rejection_sample(
    p: torch.Tensor, q: torch.Tensor, draft: Sequence[int], generator: torch.Generator | None
) -> list[int]:
    """The tokens one verified draft emits: the accepted drafts, then one token. p: (k+1, V)
    the target's distributions, q: (k, V) the draft's, `draft`: the k tokens drawn from q."""
    k = len(draft)
    ids = torch.tensor(draft, device=p.device)[:, None]
    u = uniforms(k, generator, p.device)
    pd, qd = p[:k].gather(1, ids)[:, 0], q.gather(1, ids)[:, 0]
    # accept d with probability min(1, p(d) / q(d)): u * q(d) < p(d)
    rejected = (u * qd >= pd).tolist()
    n = rejected.index(True) if True in rejected else k
    if n < k:
        dist = (p[n] - q[n]).clamp(min=0)
        if not bool(dist.sum() > 0):  # p == q up to rounding: max(0, p - q) is empty
            dist = p[n]
    else:
        dist = p[k]
    return [*draft[:n], *draw(dist[None], uniforms(1, generator, p.device))]


def verify_drafts(
    logits: torch.Tensor,
    rows: list[SampleRequest],
    batch: list[ScheduledRequest],
    drafts: dict[str, Draft],
    out: RunnerOutput,
) -> tuple[torch.Tensor, list[SampleRequest], list[ScheduledRequest]]:
    """Verify the requests of `batch` that have a `drafts` entry (each with 1 + k rows of
    `logits` and `rows`, in batch order) by the rejection rule, into `out`; return the logits
    rows, rows and requests left for the sampler."""
    keep: list[int] = []
    left: list[ScheduledRequest] = []
    r = 0
    for s in batch:
        n = 1 + len(s.spec_token_ids)
        span = list(range(r, r + n))
        r += n
        draft = drafts.get(s.request_id)
        if draft is None:
            keep += span
            left.append(s)
            continue
        mine = [rows[i] for i in span]
        meta = SamplingMetadata.build(mine, logits.shape[1], logits.device)
        p = sampling_probs(logits[span], mine, meta)
        tokens = rejection_sample(p, draft.probs, s.spec_token_ids, draft.generator)
        _emit(out, s, tokens, logits[span[: len(tokens)]], mine[0].params.logprobs)
    return logits[keep], [rows[i] for i in keep], left


def _emit(
    out: RunnerOutput,
    s: ScheduledRequest,
    tokens: list[int],
    raw: torch.Tensor,
    num_top: int | None,
) -> None:
    """As spec_verify.accept does: the first token, then the others (log-probs of the raw
    logits of their rows)."""
    rid = s.request_id
    out.sampled_token_ids[rid] = tokens[0]
    out.spec_token_ids[rid] = tokens[1:]
    if num_top is not None:
        ids = torch.tensor(tokens, device=raw.device)
        scored = token_logprobs(raw, ids, num_top)
        out.logprobs[rid] = scored[0]
        out.spec_logprobs[rid] = scored[1:]

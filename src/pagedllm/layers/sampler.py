"""Vectorized sampler: per-request parameters become tensors once per step, then every row is
processed together. Order as in vLLM: min_tokens masking, penalties, temperature, min_p,
top-k/top-p, then the exponential (Gumbel-max) draw `argmax(probs / Exponential(1))`, which
needs no host sync and takes a per-request generator for seeded requests.

Log-probabilities are those of the model's raw logits (vLLM's default `raw_logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.sampling_params import SamplingParams


@dataclass
class SampleRequest:
    """One row to sample: a request's parameters and token history (references, no copies)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None
    # token ids masked until `params.min_tokens` outputs exist (EOS + stop_token_ids)
    stop_ids: Sequence[int] = ()


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row, when logprobs were asked: (top ids, top logprobs, chosen logprob, chosen rank)
    logprobs: list[tuple[list[int], list[float], float, int] | None]


@dataclass
class SamplingMetadata:
    all_greedy: bool
    temperature: torch.Tensor  # (S, 1); 1.0 on greedy rows
    greedy: torch.Tensor  # (S,) bool
    top_k: torch.Tensor | None  # (S,) int64, vocab size where disabled
    top_p: torch.Tensor | None  # (S,)
    min_p: torch.Tensor | None  # (S, 1)
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rep, freq, pres (S, 1)
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) to mask
    generators: dict[int, torch.Generator]
    max_logprobs: int  # -1: none asked

    @staticmethod
    def build(rows: Sequence[SampleRequest], vocab: int, device: torch.device) -> SamplingMetadata:
        ps = [r.params for r in rows]

        def col(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        greedy = [p.greedy for p in ps]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in ps]
        masked = [
            (i, t)
            for i, r in enumerate(rows)
            if len(r.output_token_ids) < r.params.min_tokens
            for t in r.stop_ids
            if t < vocab
        ]
        has_pen = any(
            p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in ps
        )
        return SamplingMetadata(
            all_greedy=all(greedy),
            temperature=col(
                [1.0 if g else p.temperature for g, p in zip(greedy, ps, strict=False)]
            )[:, None],
            greedy=torch.tensor(greedy, device=device),
            top_k=torch.tensor(top_k, device=device) if any(k < vocab for k in top_k) else None,
            top_p=col([p.top_p for p in ps]) if any(p.top_p < 1 for p in ps) else None,
            min_p=col([p.min_p for p in ps])[:, None] if any(p.min_p > 0 for p in ps) else None,
            penalties=(
                (
                    col([p.repetition_penalty for p in ps])[:, None],
                    col([p.frequency_penalty for p in ps])[:, None],
                    col([p.presence_penalty for p in ps])[:, None],
                )
                if has_pen
                else None
            ),
            min_tokens_mask=(
                (
                    torch.tensor([i for i, _ in masked], device=device),
                    torch.tensor([t for _, t in masked], device=device),
                )
                if masked
                else None
            ),
            generators={i: r.generator for i, r in enumerate(rows) if r.generator is not None},
            max_logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=-1),
        )


def _token_mask(ids: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(S, V) counts of each token id per row."""
    width = max((len(x) for x in ids), default=0)
    padded = torch.full((len(ids), width + 1), vocab, dtype=torch.int64, device=device)
    for i, x in enumerate(ids):  # NOTE: only for rows' histories when penalties are on
        padded[i, : len(x)] = torch.as_tensor(list(x), dtype=torch.int64)
    counts = torch.zeros(len(ids), vocab + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor, rows: Sequence[SampleRequest], meta: SamplingMetadata
) -> torch.Tensor:
    assert meta.penalties is not None
    rep, freq, pres = meta.penalties
    vocab = logits.shape[1]
    out_counts = _token_mask([r.output_token_ids for r in rows], vocab, logits.device)
    seen = (out_counts + _token_mask([r.prompt_token_ids for r in rows], vocab, logits.device)) > 0
    # repetition (prompt and output tokens): shrink positive logits, grow negative ones
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - freq * out_counts - pres * (out_counts > 0)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) all but each row's top-k tokens and its smallest nucleus of mass top_p."""
    sorted_logits, idx = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[1]
    if top_k is not None:
        # the k-th largest value; everything below it goes
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(min=0)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p)[:, None]
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)


class Sampler:
    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SampleRequest], meta: SamplingMetadata
    ) -> SamplerOutput:
        """logits: (S, V) fp32, one row per request to sample."""
        raw = logits
        if meta.min_tokens_mask is not None:
            logits = logits.index_put(meta.min_tokens_mask, torch.tensor(float("-inf")))
        if meta.penalties is not None:
            logits = apply_penalties(logits, rows, meta)
        tokens = logits.argmax(dim=-1) if meta.all_greedy else self._sample(logits, meta)
        token_list = tokens.tolist()
        logprobs = self._logprobs(raw, tokens, rows, meta) if meta.max_logprobs >= 0 else None
        return SamplerOutput(token_list, logprobs or [None] * len(rows))

    @staticmethod
    def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy_tokens = logits.argmax(dim=-1)
        logits = logits / meta.temperature
        if meta.min_p is not None:
            probs = logits.softmax(dim=-1)
            threshold = meta.min_p * probs.amax(dim=-1, keepdim=True)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for i, gen in meta.generators.items():  # seeded rows draw from their own stream
            noise[i].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(meta.greedy, greedy_tokens, sampled)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor,
        tokens: torch.Tensor,
        rows: Sequence[SampleRequest],
        meta: SamplingMetadata,
    ) -> list[tuple[list[int], list[float], float, int] | None]:
        logprobs = raw.log_softmax(dim=-1)
        chosen = logprobs.gather(1, tokens[:, None])
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        top_vals, top_ids = logprobs.topk(max(meta.max_logprobs, 0), dim=-1)
        chosen_l, ranks_l = chosen[:, 0].tolist(), ranks.tolist()
        top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
        out: list[tuple[list[int], list[float], float, int] | None] = []
        for i, r in enumerate(rows):
            n = r.params.logprobs
            if n is None:
                out.append(None)
            else:
                out.append((top_ids_l[i][:n], top_vals_l[i][:n], chosen_l[i], ranks_l[i]))
        return out


def prompt_logprobs(
    logits: torch.Tensor, next_tokens: Sequence[int], num_top: int
) -> list[tuple[list[int], list[float], float, int]]:
    """For prefill positions: logits (L, V) predicting `next_tokens` (L,)."""
    logprobs = logits.log_softmax(dim=-1)
    ids = torch.tensor(list(next_tokens), device=logits.device)
    chosen = logprobs.gather(1, ids[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    top_vals, top_ids = logprobs.topk(num_top, dim=-1)
    return [
        (top_ids[i].tolist(), top_vals[i].tolist(), chosen[i, 0].item(), ranks[i])
        for i in range(len(ids))
    ]

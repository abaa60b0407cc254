"""Vectorized sampler: per-request parameters become tensors once per step, then every row is
processed together. Order as in vLLM: min_tokens and bad-words masking, logit bias and allowed
token ids (`logit_bias`), penalties, temperature, min_p, top-k/top-p, then an inverse-CDF
draw, one uniform number per row (seeded rows draw it from their own generator). NOTE: not the
Gumbel-max `argmax(probs / Exponential(1))`: one exponential per vocabulary entry costs tens of
ms per step on a CPU at batch 64 x 49k vocab, one uniform per row costs nothing. Filters run
among each row's top candidates when they provably keep no other token. Log-probabilities are
those of the model's raw logits (vLLM's default `raw_logprobs`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.core.scheduler import TokenLogprobs
from pagedllm.layers.attention.base import host_to_device
from pagedllm.layers.logit_bias import LogitBias
from pagedllm.layers.topk import argmax_rows, topk_rows
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
    # its bans (bad words) and allowed ids are in a grammar's mask already (see
    # `ModelRunner._constrain`)
    in_mask: bool = False


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row, when logprobs were asked: (top ids, top logprobs, chosen logprob, chosen rank)
    logprobs: list[TokenLogprobs | None]


@dataclass
class SamplingMetadata:
    all_greedy: bool
    any_greedy: bool
    # both None when all rows are greedy (each op run cold after a step costs ~0.1 ms on a CPU)
    temperature: torch.Tensor | None  # (S, 1); 1.0 on greedy rows
    greedy: torch.Tensor | None  # (S,) bool
    top_k: torch.Tensor | None  # (S,) int64, vocab size where disabled
    top_p: torch.Tensor | None  # (S,)
    min_p: torch.Tensor | None  # (S, 1)
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rep, freq, pres (S, 1)
    # (rows, token ids) set to -inf: stop ids before min_tokens, bad words' next tokens
    banned: tuple[torch.Tensor, torch.Tensor] | None
    generators: dict[int, torch.Generator]
    max_logprobs: int  # -1: none asked
    bias: LogitBias | None = None  # logit_bias, allowed_token_ids

    @staticmethod
    def build(rows: Sequence[SampleRequest], vocab: int, device: torch.device) -> SamplingMetadata:
        ps = [r.params for r in rows]
        col = functools.partial(host_to_device, device=device, dtype=torch.float32)
        ints = functools.partial(host_to_device, device=device, dtype=torch.int64)
        greedy = [p.greedy for p in ps]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in ps]
        masked = [
            (i, t)
            for i, r in enumerate(rows)
            if len(r.output_token_ids) < r.params.min_tokens
            for t in r.stop_ids
            if t < vocab
        ]
        if any(p.bad_words_token_ids for p in ps):
            masked += bad_word_bans(rows)
        has_pen = any(
            p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in ps
        )
        all_greedy = all(greedy)
        temps = [1.0 if g else p.temperature for g, p in zip(greedy, ps, strict=False)]
        return SamplingMetadata(
            all_greedy=all_greedy,
            any_greedy=any(greedy),
            temperature=None if all_greedy else col(temps)[:, None],
            greedy=None if all_greedy else host_to_device(greedy, device, torch.bool),
            top_k=ints(top_k) if any(k < vocab for k in top_k) else None,
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
            banned=(
                (
                    ints([i for i, _ in masked]),
                    ints([t for _, t in masked]),
                )
                if masked
                else None
            ),
            generators={i: r.generator for i, r in enumerate(rows) if r.generator is not None},
            max_logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=-1),
            bias=LogitBias.build(ps, [r.in_mask for r in rows], vocab, device),
        )


def bad_word_bans(rows: Sequence[SampleRequest]) -> list[tuple[int, int]]:
    """(row, token id) pairs to ban, as vLLM: a banned sequence's last token, where the row's
    output tokens (not its prompt) end with the rest of the sequence."""
    bans = []
    for i, r in enumerate(rows):
        if r.in_mask:
            continue
        out = r.output_token_ids
        for seq in r.params.bad_words_token_ids:
            n = len(seq) - 1
            if n == 0 or (n <= len(out) and list(out[-n:]) == seq[:-1]):
                bans.append((i, seq[-1]))
    return bans


def _pad_ids(ids: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max((len(x) for x in ids), default=0))
    rows = [[*x, *([pad] * (width - len(x)))] for x in ids]
    return host_to_device(rows, device, torch.int64)


def apply_penalties(
    logits: torch.Tensor, rows: Sequence[SampleRequest], meta: SamplingMetadata
) -> torch.Tensor:
    """Repetition (prompt and output tokens), frequency and presence (output tokens) penalties,
    in place, applied sparsely at the tokens each row has seen: (S, history) work, not (S, V).
    Returns `logits`."""
    assert meta.penalties is not None
    rep, freq, pres = meta.penalties
    vocab, device = logits.shape[1], logits.device
    # ragged id lists are padded with `vocab`; padding then points at an id the row has seen
    # (its first prompt token) and adds nothing
    anchor = host_to_device([r.prompt_token_ids[0] for r in rows], device, torch.int64)[:, None]
    out_ids = _pad_ids([r.output_token_ids for r in rows], vocab, device)
    seen_ids = torch.cat([_pad_ids([r.prompt_token_ids for r in rows], vocab, device), out_ids], 1)
    seen_ids = torch.where(seen_ids < vocab, seen_ids, anchor)
    # repetition: shrink positive logits, grow negative ones; a repeated id writes the same
    # value again, so each token is penalized once whatever its count
    seen = logits.gather(1, seen_ids)
    logits.scatter_(1, seen_ids, torch.where(seen > 0, seen / rep, seen * rep))
    # frequency: once per occurrence
    valid = out_ids < vocab
    logits.scatter_add_(1, torch.where(valid, out_ids, anchor), torch.where(valid, -freq, 0.0))
    # presence: once per distinct token (the first of each run of equal sorted ids; the
    # padding sorts last and forms runs of its own)
    ids = out_ids.sort(dim=1).values
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    valid = ids < vocab
    logits.scatter_add_(1, torch.where(valid, ids, anchor), torch.where(first & valid, -pres, 0.0))
    return logits


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


# rows are filtered among their top candidates when the filters provably keep no other token
CANDIDATES = 1024
RANK_SCAN = 64


def _uniforms(n: int, meta: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """One uniform draw per row; seeded rows draw from their own stream."""
    u = torch.rand(n, device=device)
    for i, gen in meta.generators.items():
        u[i] = torch.rand(1, generator=gen, device=gen.device)[0]
    return u


def inverse_cdf(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample each row of softmax(logits) with its uniform: the first token whose cumulative
    probability exceeds u (-inf logits have no mass and are never chosen)."""
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    return idx[:, 0].clamp(max=logits.shape[1] - 1)


def _min_p_threshold(top: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    # probs_i < min_p * max_prob  <=>  logit_i < max_logit + log(min_p)
    return top + torch.log(min_p)


def filter_candidates(
    logits: torch.Tensor, meta: SamplingMetadata
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """min_p, top-k and top-p among each row's top candidates: (values with the filtered ones
    at -inf, their token ids, whether the row's filtered support provably lies within them)."""
    num, vocab = logits.shape
    # when every row is top-k limited its k suffice, else CANDIDATES
    max_k = int(meta.top_k.max()) if meta.top_k is not None else vocab
    k = min(vocab, max_k if max_k < vocab else CANDIDATES)
    vals, idx = topk_rows(logits, k)  # (S, K), descending
    pos = torch.arange(k, device=logits.device)
    fits = torch.full((num,), k == vocab, device=logits.device)
    support = torch.ones_like(logits[:, :1], dtype=torch.bool).expand(num, k)
    if meta.top_k is not None:
        fits |= meta.top_k <= k
        support = support & (pos < meta.top_k[:, None])
    threshold = None
    if meta.min_p is not None:
        threshold = _min_p_threshold(vals[:, :1], meta.min_p)
        support = support & (vals >= threshold)
        fits |= vals[:, -1] < threshold[:, 0]
    vals = vals.masked_fill(~support, float("-inf"))
    if meta.top_p is not None:
        vals, nucleus_fits = _top_p_candidates(logits, vals, fits, threshold, meta.top_p)
        fits |= nucleus_fits
    return vals, idx, fits


def _sample_filtered(logits: torch.Tensor, u: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    vals, idx, fits = filter_candidates(logits, meta)
    tokens = idx.gather(1, inverse_cdf(vals, u)[:, None])[:, 0]
    if not bool(fits.all()):  # rare: a flat distribution whose nucleus passes the candidates
        rows = (~fits).nonzero()[:, 0]
        tokens[rows] = inverse_cdf(filter_full(logits[rows], meta, rows), u[rows])
    return tokens


def _top_p_candidates(
    logits: torch.Tensor,
    vals: torch.Tensor,
    fits: torch.Tensor,
    threshold: torch.Tensor | None,
    top_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each row's smallest prefix of mass >= top_p. The mass is normalized over the row's
    support: the candidates where they hold it all, the full (min_p-filtered) row otherwise;
    then the nucleus fits if the candidates reach top_p."""
    lse = vals.logsumexp(dim=-1)
    if not bool(fits.all()):
        full = (
            logits if threshold is None else logits.masked_fill(logits < threshold, float("-inf"))
        )
        lse = torch.where(fits, lse, full.logsumexp(dim=-1))
    probs = (vals - lse[:, None]).exp()
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely candidates
    drop = before >= top_p[:, None]
    drop[:, 0] = False
    nucleus_fits = probs.sum(dim=-1) >= top_p
    return vals.masked_fill(drop, float("-inf")), nucleus_fits


def filter_full(logits: torch.Tensor, meta: SamplingMetadata, rows: torch.Tensor) -> torch.Tensor:
    """The same filters over the whole vocabulary, for a few rows (sorts them for top-p)."""
    if meta.min_p is not None:
        top = logits.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(logits < _min_p_threshold(top, meta.min_p[rows]), float("-inf"))
    top_k = meta.top_k[rows] if meta.top_k is not None else None
    top_p = meta.top_p[rows] if meta.top_p is not None else None
    if top_k is None and top_p is None:
        return logits
    return apply_top_k_top_p(logits, top_k, top_p)


class Sampler:
    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SampleRequest], meta: SamplingMetadata
    ) -> SamplerOutput:
        """logits: (S, V) fp32, one row per request to sample."""
        raw = logits
        logits = self.adjust(logits, rows, meta)
        tokens = argmax_rows(logits) if meta.all_greedy else self._sample(logits, meta)
        token_list = tokens.tolist()
        logprobs = self._logprobs(raw, tokens, rows, meta) if meta.max_logprobs >= 0 else None
        return SamplerOutput(token_list, logprobs or [None] * len(rows))

    @staticmethod
    def adjust(
        logits: torch.Tensor, rows: Sequence[SampleRequest], meta: SamplingMetadata
    ) -> torch.Tensor:
        """Bans, logit bias and penalties applied (to a copy, if any applies)."""
        if meta.banned is not None or meta.penalties is not None or meta.bias is not None:
            logits = logits.clone()  # raw stays for the log-probabilities
        if meta.banned is not None:
            logits.index_put_(meta.banned, torch.tensor(float("-inf")))
        if meta.bias is not None:
            meta.bias.apply_(logits)
        if meta.penalties is not None:
            apply_penalties(logits, rows, meta)
        return logits

    @staticmethod
    def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        assert meta.temperature is not None and meta.greedy is not None  # not all greedy
        greedy_tokens = argmax_rows(logits) if meta.any_greedy else None
        logits = logits / meta.temperature
        u = _uniforms(logits.shape[0], meta, logits.device)
        if meta.top_k is None and meta.top_p is None and meta.min_p is None:
            sampled = inverse_cdf(logits, u)
        else:
            sampled = _sample_filtered(logits, u, meta)
        return (
            sampled if greedy_tokens is None else torch.where(meta.greedy, greedy_tokens, sampled)
        )

    @staticmethod
    def _logprobs(
        raw: torch.Tensor,
        tokens: torch.Tensor,
        rows: Sequence[SampleRequest],
        meta: SamplingMetadata,
    ) -> list[TokenLogprobs | None]:
        per_row = token_logprobs(raw, tokens, max(meta.max_logprobs, 0))
        return [
            None
            if r.params.logprobs is None
            else (top_ids[: r.params.logprobs], top_vals[: r.params.logprobs], chosen, rank)
            for r, (top_ids, top_vals, chosen, rank) in zip(rows, per_row, strict=True)
        ]


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, num_top: int) -> list[TokenLogprobs]:
    """Per row of logits (S, V): (top ids, their log-probs, log-prob of `ids[row]`, its rank).
    Ranks compare raw logits (same order as log-probs); log-probs are logit - logsumexp."""
    lse = logits.logsumexp(dim=-1, keepdim=True)
    chosen = logits.gather(1, ids[:, None])
    # the rank from the best RANK_SCAN values where the chosen token is among them (the
    # usual case), else by counting the whole row
    scan = min(max(num_top, RANK_SCAN), logits.shape[1])
    top_vals, top_ids = topk_rows(logits, scan)
    ranks_t = (top_vals > chosen).sum(dim=-1, dtype=torch.int32) + 1
    outside = chosen[:, 0] < top_vals[:, -1]
    if bool(outside.any()):
        rows = outside.nonzero()[:, 0]
        ranks_t[rows] = (logits[rows] > chosen[rows]).sum(dim=-1, dtype=torch.int32) + 1
    ranks = ranks_t.tolist()
    top_vals, top_ids = top_vals[:, :num_top], top_ids[:, :num_top]
    top_ids_l, top_vals_l = top_ids.tolist(), (top_vals - lse).tolist()
    chosen_l = (chosen - lse)[:, 0].tolist()
    return list(zip(top_ids_l, top_vals_l, chosen_l, ranks, strict=True))


def prompt_logprobs(
    logits: torch.Tensor, next_tokens: Sequence[int], num_top: int
) -> list[TokenLogprobs]:
    """For prefill positions: logits (L, V) predicting `next_tokens` (L,)."""
    ids = torch.tensor(list(next_tokens), dtype=torch.int64, device=logits.device)
    return token_logprobs(logits, ids, num_top)

"""The sampler against independent references: HF `transformers` logits warpers/processors and
plain torch formulas for the masks, penalties, min_tokens, the sampled distribution, seeds and
logprobs (`SamplingParams` in tests/test_sampling_params.py; the same properties end to end
through `LLM.generate` in tests/test_sampler_e2e.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pagedllm import SamplingParams
from pagedllm.layers.sampler import (
    Sampler,
    SampleRequest,
    SamplingMetadata,
    apply_penalties,
    apply_top_k_top_p,
    prompt_logprobs,
)

CPU = torch.device("cpu")
NO_IDS = torch.zeros(1, 0, dtype=torch.long)  # HF warpers ignore input_ids


def make_row(
    params: SamplingParams,
    prompt: Sequence[int] = (2, 3),
    output: Sequence[int] = (),
    generator: torch.Generator | None = None,
    stop_ids: Sequence[int] = (),
) -> SampleRequest:
    return SampleRequest(params, list(prompt), list(output), generator, stop_ids)


def sample(logits: torch.Tensor, rows: list[SampleRequest]) -> list[int]:
    meta = SamplingMetadata.build(rows, logits.shape[1], CPU)
    return Sampler()(logits, rows, meta).token_ids


def hf_warp(logits: torch.Tensor, p: SamplingParams, upto: str = "top_p") -> torch.Tensor:
    """HF warpers on one row (V,), in our sampler's order: temperature, min_p, top-k, top-p;
    `upto="min_p"` stops after the min_p step."""
    warpers: list[Any] = [TemperatureLogitsWarper(p.temperature)]
    if p.min_p > 0:
        warpers.append(MinPLogitsWarper(p.min_p))
    if upto == "top_p":
        if p.top_k > 0:
            warpers.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1:
            warpers.append(TopPLogitsWarper(p.top_p))
    x = logits[None].clone()
    for w in warpers:
        x = w(NO_IDS, x)
    return x[0]


# --- masks ---------------------------------------------------------------------------------

V = 1000
# per row (top_k, top_p); 0 / 1.0 = disabled. Every row differs: the mask is vectorized
MASK_PARAMS = [(0, 1.0), (1, 1.0), (7, 1.0), (0, 0.9), (0, 0.05), (50, 0.5), (999, 0.99), (3, 0.3)]


@pytest.mark.parametrize("which", ["both", "top_k", "top_p"])
def test_top_k_top_p_mask_matches_hf(which: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(len(MASK_PARAMS), V) * 3
    top_k = torch.tensor([k if k > 0 else V for k, _ in MASK_PARAMS])
    top_p = torch.tensor([p for _, p in MASK_PARAMS])
    use_k, use_p = which in ("both", "top_k"), which in ("both", "top_p")
    got = apply_top_k_top_p(logits, top_k if use_k else None, top_p if use_p else None)
    for i, (k, p) in enumerate(MASK_PARAMS):
        ref = logits[i : i + 1].clone()
        if use_k and k > 0:
            ref = TopKLogitsWarper(k)(NO_IDS, ref)
        if use_p and p < 1:
            ref = TopPLogitsWarper(p)(NO_IDS, ref)
        kept = ref[0].isfinite()
        assert torch.equal(got[i].isfinite(), kept), f"row {i} (top_k={k}, top_p={p})"
        assert torch.equal(got[i][kept], logits[i][kept])  # survivors keep their values
    # the parameters really cut something, and differently per row
    kept_counts = got.isfinite().sum(dim=1).tolist()
    assert len(set(kept_counts)) >= 4 and min(kept_counts) < V


# > 1024: a sampler that pre-selects each row's top candidates must also take its exact path
V_BIG = 2048
FILTER_PARAMS = [
    SamplingParams(temperature=0.8, min_p=0.1),
    SamplingParams(temperature=2.5, min_p=0.2),
    SamplingParams(temperature=1.5, top_k=8),
    SamplingParams(temperature=1.0, top_k=12, min_p=0.05),
    SamplingParams(temperature=0.3, top_p=0.9),
    SamplingParams(temperature=1.5, top_k=30, top_p=0.7),
    SamplingParams(temperature=1.0, min_p=0.02, top_k=40, top_p=0.8),
    # a nucleus of 1673 tokens: 95 % of the mass, 19 % of it beyond the 1024 most likely
    # tokens; the 5 % cut must never be drawn
    SamplingParams(temperature=4.0, top_p=0.95),
    SamplingParams(temperature=0, top_k=3),  # greedy row in the same batch
]
FILTER_DRAWS = 1000


def test_sampler_filters_match_hf_warpers() -> None:
    """Each row (own logits, own parameters, one batch) draws exactly from HF's kept set.
    Rows 0-6 keep <= 26 tokens of probability >= 0.024 each, so in 1000 draws every kept
    token shows up (a miss has probability < e^-24) and the drawn set must *equal* HF's; a
    token wrongly kept at the cut (min_p / top-k / top-p off by one) carries a comparable
    mass and would show up too. Frequencies within 0.07 (> 4.4 sigma at N = 1000) check the
    temperature and renormalization, token by token and over bands of the long tail."""
    gen = torch.Generator().manual_seed(1)
    row_logits = torch.randn(len(FILTER_PARAMS), V_BIG, generator=gen) * 3
    torch.manual_seed(1)
    n = len(FILTER_PARAMS)
    rows = [make_row(p) for p in FILTER_PARAMS] * FILTER_DRAWS  # row r: params r % n
    tokens = torch.tensor(sample(row_logits.repeat(FILTER_DRAWS, 1), rows)).view(-1, n)
    for i, p in enumerate(FILTER_PARAMS):
        drawn = tokens[:, i]
        if p.greedy:
            assert (drawn == row_logits[i].argmax()).all()
            continue
        expected = hf_warp(row_logits[i], p).softmax(dim=-1)
        kept = expected > 0
        counts = torch.bincount(drawn, minlength=V_BIG)
        assert not counts[~kept].any(), f"row {i} ({p}) drew a filtered-out token"
        if i < 7:
            assert expected[kept].min() >= 0.024  # the design above holds
            assert torch.equal(counts > 0, kept), f"row {i} ({p}): a kept token never drawn"
        freq = counts.float() / FILTER_DRAWS
        assert (freq - expected).abs().max() < 0.07, f"row {i} ({p})"
        # the long tail by bands of expected rank: [0, 8), [8, 64), [64, 512), [512, V)
        order = expected.argsort(descending=True)
        for lo, hi in ((0, 8), (8, 64), (64, 512), (512, V_BIG)):
            band = order[lo:hi]
            assert abs(freq[band].sum() - expected[band].sum()) < 0.07, f"row {i}, {lo}-{hi}"


# --- penalties -----------------------------------------------------------------------------


def test_penalties_match_formulas() -> None:
    vocab = 40
    torch.manual_seed(2)
    logits = torch.randn(5, vocab) * 3
    # (prompt, output, repetition, frequency, presence): all rows differ; repeated tokens,
    # tokens only in the prompt (repetition only), tokens in both
    cases = [
        ([3, 4, 5, 3], [6, 6, 6, 7], 1.3, 0.5, 0.25),
        ([8, 9], [], 2.0, 1.0, 1.0),
        ([10, 11, 12], [10, 13, 13], 0.8, -0.4, 0.7),
        ([14], [15, 16, 15, 15, 14], 1.0, 1.5, 0.0),
        ([17, 18], [19, 19], 1.0, 0.0, -1.2),
    ]
    rows = [
        make_row(
            SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres),
            prompt,
            output,
        )
        for prompt, output, rep, freq, pres in cases
    ]
    meta = SamplingMetadata.build(rows, vocab, CPU)
    got = apply_penalties(logits.clone(), rows, meta)
    for i, (prompt, output, rep, freq, pres) in enumerate(cases):
        ids = torch.tensor([prompt + output])
        ref = RepetitionPenaltyLogitsProcessor(rep)(ids, logits[i : i + 1].clone())[0]
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).float()
        ref = ref - freq * counts - pres * (counts > 0).float()
        torch.testing.assert_close(got[i], ref, rtol=0, atol=1e-6)
    assert not torch.equal(got, logits)


# --- min_tokens ----------------------------------------------------------------------------


def test_min_tokens_masks_stop_ids_until_reached() -> None:
    vocab, eos, stop = 50, 1, [7, 9]
    stop_ids = [eos, *stop]
    torch.manual_seed(3)
    base = torch.randn(vocab)
    # the stop ids hold all but ~1e-8 of the mass: only a -inf mask keeps them from being drawn
    base[eos], base[7], base[9] = 20.0, 25.0, 22.0
    rows, lengths = [], []
    for num_out in range(5):  # min_tokens = 3: masked while fewer than 3 outputs exist
        for p in (
            SamplingParams(temperature=0, min_tokens=3),
            SamplingParams(temperature=1.0, min_tokens=3),
            SamplingParams(temperature=2.0, min_tokens=3, top_k=10, min_p=0.01),
        ):
            rows.append(make_row(p, output=[20] * num_out, stop_ids=stop_ids))
            lengths.append(num_out)
    rows, lengths = rows * 200, lengths * 200  # many draws of each row
    tokens = sample(base.repeat(len(rows), 1), rows)
    best_other = base.clone()
    best_other[stop_ids] = float("-inf")
    for row, num_out, token in zip(rows, lengths, tokens, strict=True):
        if num_out < 3:
            assert token not in stop_ids
            if row.params.greedy:
                assert token == best_other.argmax().item()
        elif row.params.greedy:
            assert token == 7
        else:
            assert token in stop_ids  # no longer masked


# --- the sampled distribution --------------------------------------------------------------

DIST_LOGITS = torch.tensor([2.0, 1.4, 1.0, 0.3, -0.4, -1.5])
DIST_PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(temperature=0.8, top_p=0.7),
    SamplingParams(temperature=1.6, min_p=0.3),
    SamplingParams(temperature=1.5, top_k=5, top_p=0.85, min_p=0.15),
]
NUM_DRAWS = 20_000
# The empirical frequency of a token of probability q over N draws has standard deviation
# sqrt(q (1 - q) / N) <= sqrt(0.25 / 20000) = 0.0035, so |freq - q| < 0.015 holds at > 4
# sigma for every token of every row (and the draw is seeded: no flakes). With these logits
# each wrong implementation moves some token's probability by at least 5x the bound: no
# temperature (0.11 on row 0, 0.19 on row 2), drawing from the logits instead of the
# probabilities (Gumbel-max on logits: 0.13, row 0), top-k keeping k - 1 / k + 1 tokens
# (0.22 / 0.11, row 1), a top-p cutoff one token short / long (0.32 / 0.16, row 2), min_p
# dropped or taken before temperature (0.08 / 0.14, row 3), filters not composed (row 4).
MAX_FREQ_ERROR = 0.015


def test_sampled_frequencies_match_filtered_softmax() -> None:
    torch.manual_seed(4)
    greedy_logits = DIST_LOGITS.flip(0)  # argmax = token 5: greedy rows differ from the rest
    rows: list[SampleRequest] = []
    logits = []
    for p in DIST_PARAMS:
        rows += [make_row(p)] * NUM_DRAWS
        logits.append(DIST_LOGITS.repeat(NUM_DRAWS, 1))
    greedy = SamplingParams(temperature=0, top_k=4, top_p=0.99)  # filters that keep 4 tokens
    rows += [make_row(greedy)] * 500
    logits.append(greedy_logits.repeat(500, 1))
    tokens = torch.tensor(sample(torch.cat(logits), rows))
    for j, p in enumerate(DIST_PARAMS):
        drawn = tokens[j * NUM_DRAWS : (j + 1) * NUM_DRAWS]
        freq = torch.bincount(drawn, minlength=6).float() / NUM_DRAWS
        expected = hf_warp(DIST_LOGITS, p).softmax(dim=-1)
        err = (freq - expected).abs().max().item()
        assert err < MAX_FREQ_ERROR, f"{p}: freq {freq.tolist()} vs {expected.tolist()}"
    assert (tokens[len(DIST_PARAMS) * NUM_DRAWS :] == 5).all()


# --- seeds ---------------------------------------------------------------------------------

STEPS = 6


def seeded_sequence(seed: int, position: int, others: list[SamplingParams]) -> list[int]:
    """The tokens a seeded row draws over STEPS steps when batched with `others` at
    `position`; the row's logits at step t are fixed, the others' logits vary."""
    target = SamplingParams(temperature=0.9, top_p=0.95, min_p=0.001)
    gen = torch.Generator().manual_seed(seed)
    other_gens = [torch.Generator().manual_seed(100 + k) if k % 2 else None for k in range(9)]
    noise = torch.Generator().manual_seed(seed * 7 + position + len(others))
    out: list[int] = []
    other_outs: list[list[int]] = [[] for _ in others]
    for t in range(STEPS):
        row_logits = torch.randn(V_BIG, generator=torch.Generator().manual_seed(1000 + t))
        rows = [
            make_row(p, output=o, generator=other_gens[k])
            for k, (p, o) in enumerate(zip(others, other_outs, strict=True))
        ]
        rows.insert(position, make_row(target, output=out, generator=gen))
        logits = torch.randn(len(rows), V_BIG, generator=noise) * 2
        logits[position] = row_logits
        tokens = sample(logits, rows)
        out.append(tokens.pop(position))
        for o, tok in zip(other_outs, tokens, strict=True):
            o.append(tok)
    return out


def test_seeded_row_independent_of_batch() -> None:
    torch.manual_seed(5)
    alone = seeded_sequence(1234, 0, [])
    batches = [
        (2, [SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_k=5)]),
        (0, [SamplingParams(temperature=0.3, repetition_penalty=1.5, frequency_penalty=1.0)]),
        (
            4,
            [
                SamplingParams(min_p=0.2),
                SamplingParams(temperature=0),
                SamplingParams(top_p=0.5, presence_penalty=1.0),
                SamplingParams(temperature=2.0),
                SamplingParams(temperature=0.5, top_k=3),
            ],
        ),
    ]
    for position, others in batches:
        assert seeded_sequence(1234, position, others) == alone, (position, others)
    assert seeded_sequence(1235, 0, []) != alone
    assert seeded_sequence(99, 2, batches[0][1]) != alone


# --- logprobs ------------------------------------------------------------------------------


def check_logprobs(
    entry: tuple[list[int], list[float], float, int], ref: torch.Tensor, token: int, n: int
) -> None:
    """`ref`: (V,) float64 log_softmax of the raw logits."""
    top_ids, top_vals, chosen, rank = entry
    assert top_ids == ref.topk(n).indices.tolist()
    # fp32 logit - logsumexp against a float64 log_softmax: 1e-5 absolute
    torch.testing.assert_close(
        torch.tensor(top_vals, dtype=torch.float64), ref.topk(n).values, rtol=0, atol=1e-5
    )
    assert abs(chosen - ref[token].item()) < 1e-5
    assert rank == 1 + int((ref > ref[token]).sum())


def test_sample_logprobs_are_raw_log_softmax() -> None:
    torch.manual_seed(6)
    params = [
        SamplingParams(logprobs=3, temperature=2.0),
        SamplingParams(),  # no logprobs asked
        SamplingParams(logprobs=0, temperature=0),
        # penalties and min_tokens change what is sampled, not the reported logprobs
        SamplingParams(logprobs=5, temperature=0, repetition_penalty=3.0, min_tokens=2),
        SamplingParams(logprobs=1, temperature=1.0, top_k=4, frequency_penalty=2.0),
    ]
    logits = torch.randn(len(params), V) * 2
    logits[3, 42] = 30.0  # the raw argmax of row 3 is a stop id, masked by min_tokens
    rows = [
        make_row(p, prompt=[5, 6], output=[7], stop_ids=[42] if p.min_tokens else ())
        for p in params
    ]
    meta = SamplingMetadata.build(rows, V, CPU)
    out = Sampler()(logits.clone(), rows, meta)
    ref = logits.double().log_softmax(dim=-1)
    assert out.logprobs[1] is None
    for i, p in enumerate(params):
        if p.logprobs is not None:
            entry = out.logprobs[i]
            assert entry is not None
            check_logprobs(entry, ref[i], out.token_ids[i], p.logprobs)
    entry = out.logprobs[3]
    assert entry is not None and entry[3] == 2 and entry[0][0] == 42  # chosen: not the raw top


def test_prompt_logprobs_function() -> None:
    torch.manual_seed(7)
    logits = torch.randn(9, 300) * 2
    next_tokens = torch.randint(0, 300, (9,)).tolist()
    next_tokens[0] = logits[0].argmax().item()  # a rank-1 entry
    got = prompt_logprobs(logits, next_tokens, 4)
    ref = logits.double().log_softmax(dim=-1)
    assert len(got) == 9
    for i, entry in enumerate(got):
        check_logprobs(entry, ref[i], next_tokens[i], 4)
    assert got[0][3] == 1


def test_all_greedy_builds_no_temperature_tensors() -> None:
    """All rows greedy: argmax alone reads the logits, so no per-row temperature / greedy
    tensor is built; one sampled row brings both back, and the greedy rows still take argmax."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    greedy = [make_row(SamplingParams(temperature=0)) for _ in range(3)]
    meta = SamplingMetadata.build(greedy, V, CPU)
    assert meta.all_greedy and meta.temperature is None and meta.greedy is None
    assert Sampler()(logits, greedy, meta).token_ids == logits.argmax(dim=-1).tolist()
    mixed = [greedy[0], make_row(SamplingParams(temperature=0.8, seed=1)), greedy[2]]
    meta = SamplingMetadata.build(mixed, V, CPU)
    assert meta.temperature is not None and meta.greedy is not None
    tokens = Sampler()(logits, mixed, meta).token_ids
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()

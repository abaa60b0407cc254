"""`logit_bias` and `allowed_token_ids` in the sampler, against plain torch: a bias is the
logits plus a dense bias row (the same seeded draws), allowed ids are a -inf mask; the order
with bans, min_tokens and penalties is vLLM's; a grammar's mask is never emptied by either
(`bitmask.allow_only_`, a finite bias); the raw log-probs are untouched; and SamplingParams'
checks name the bad id or value."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.layers.bitmask import allow_only_, apply_token_bitmask_
from pagedllm.layers.sampler import Sampler, SampleRequest, SamplingMetadata

CPU = torch.device("cpu")
V = 96


def row(params: SamplingParams, output: list[int] | None = None, seed: int | None = None,
        stop_ids: tuple[int, ...] = (), in_mask: bool = False) -> SampleRequest:  # fmt: skip
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SampleRequest(params, [2, 3], output or [], gen, stop_ids, in_mask)


def run(logits: torch.Tensor, rows: list[SampleRequest]) -> Any:
    return Sampler()(logits, rows, SamplingMetadata.build(rows, logits.shape[1], CPU))


def logits(rows: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_bias_forces_and_forbids_under_greedy() -> None:
    x = logits()
    best = x.argmax(dim=-1).tolist()
    worst = x.argmin(dim=-1).tolist()
    rows = [
        row(SamplingParams(temperature=0, logit_bias={worst[0]: 100})),
        row(SamplingParams(temperature=0, logit_bias={str(best[1]): -100})),  # a JSON key
        row(SamplingParams(temperature=0)),
        row(SamplingParams(temperature=0, logit_bias={best[3]: -100, worst[3]: 100})),
    ]
    out = run(x, rows)
    second = x[1].topk(2).indices[1].item()
    assert out.token_ids == [worst[0], second, best[2], worst[3]]


def test_bias_is_added_to_the_logits_before_sampling() -> None:
    """Seeded random rows with a bias draw exactly what the biased logits draw without one,
    with top-k, top-p and min_p on (they filter the biased logits, as vLLM's order has it)."""
    x = logits(6, seed=1)
    bias = {5: 3.5, 17: -2.0, 40: 7.25, 90: -100.0}
    dense = torch.zeros(V)
    for t, b in bias.items():
        dense[t] = b
    knobs: list[dict[str, Any]] = [{}, {"top_k": 8}, {"top_p": 0.8}, {"min_p": 0.05}]
    for k in knobs:
        for seed in range(8):
            with_bias = [row(SamplingParams(seed=seed, logit_bias=bias, **k), seed=seed)]
            without = [row(SamplingParams(seed=seed, **k), seed=seed)]
            biased = run(x[:1].clone(), with_bias).token_ids
            assert biased == run(x[:1] + dense, without).token_ids, k


def test_raw_logprobs_are_not_biased() -> None:
    x = logits(1)
    token = x[0].argmin().item()
    out = run(x, [row(SamplingParams(temperature=0, logprobs=2, logit_bias={token: 100}))])
    assert out.token_ids == [token]
    _, _, chosen, rank = out.logprobs[0]
    assert chosen == pytest.approx((x[0] - x[0].logsumexp(0))[token].item(), abs=1e-5)
    assert rank == V  # the raw distribution's least likely token


def test_allowed_token_ids_mask_everything_else() -> None:
    x = logits(3)
    allowed = [7, 8, 9, 60]
    drawn = set()
    for seed in range(64):
        params = SamplingParams(temperature=2.0, seed=seed, allowed_token_ids=allowed)
        drawn.update(run(x[:1], [row(params, seed=seed)]).token_ids)
    assert drawn <= set(allowed) and len(drawn) > 1
    greedy = run(x, [row(SamplingParams(temperature=0, allowed_token_ids=allowed)) for _ in x])
    assert greedy.token_ids == [allowed[int(x[i, allowed].argmax())] for i in range(3)]


def test_order_with_bans_min_tokens_and_penalties() -> None:
    """A ban (min_tokens' stop id, a bad word) wins over any bias; the bias comes before the
    repetition penalty (a biased positive logit is divided), as in vLLM."""
    x = torch.zeros(1, V)
    eos = 1
    early = SamplingParams(temperature=0, min_tokens=2, logit_bias={eos: 100})
    assert run(x, [row(early, output=[5], stop_ids=(eos,))]).token_ids != [eos]
    bad = SamplingParams(temperature=0, bad_words_ids=[[30]], logit_bias={30: 100})
    bad.update_from_tokenizer(lambda word: [], V)  # as the engine resolves them
    assert run(x, [row(bad)]).token_ids != [30]
    # 10 biased +8 then /4 (repeated: 2.0); 11 biased +3 (not repeated): 11 wins
    x[0, 10], x[0, 11] = 0.0, 0.0
    pen = SamplingParams(temperature=0, repetition_penalty=4.0, logit_bias={10: 8, 11: 3})
    assert run(x, [row(pen, output=[10])]).token_ids == [11]


def test_no_bias_builds_nothing() -> None:
    rows = [row(SamplingParams(temperature=0)) for _ in range(3)]
    assert SamplingMetadata.build(rows, V, CPU).bias is None


def bitmask_allowing(ids: list[int]) -> torch.Tensor:
    words = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    for t in ids:
        words[0, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    return words


def test_grammar_mask_is_never_emptied() -> None:
    """A grammar allowing {3, 40}: -100 on both still picks one of them; allowed ids meeting it
    keep the common ones; allowed ids outside it leave the grammar's mask as it was."""
    grammar = [3, 40]
    x = logits(1)
    x[0, 64] = 50.0  # the best token, outside the grammar
    cases = [
        (SamplingParams(temperature=0, logit_bias={3: -100, 40: -100, 64: 100}), None, grammar),
        (SamplingParams(temperature=0), [40, 64], [40]),
        (SamplingParams(temperature=0), [64, 70], grammar),
    ]
    for params, allowed, expected in cases:
        mask = bitmask_allowing(grammar)
        if allowed is not None:
            allow_only_(mask, 0, allowed)
        masked = x.clone()
        apply_token_bitmask_(masked, mask, [0])
        kept = [t for t in range(V) if masked[0, t] > float("-inf")]
        assert kept == expected
        (token,) = run(masked, [row(params, in_mask=True)]).token_ids
        assert token in expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logit_bias": {"7": 101}}, r"logit_bias\[7\]: 101.0 is outside \[-100, 100\]"),
        ({"logit_bias": {"-3": 1}}, "logit_bias: -3 is not a token id"),
        ({"logit_bias": {"x": 1}}, "logit_bias key must be an integer"),
        ({"logit_bias": [1]}, "logit_bias must be an object"),
        ({"logit_bias": {"1": float("nan")}}, "must be a finite number"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"allowed_token_ids": [3, -1]}, r"allowed_token_ids\[1\]: -1 is not a token id"),
    ],
)
def test_bad_values_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_token_ids_checked_against_the_vocabulary() -> None:
    params = SamplingParams.from_dict({"logit_bias": {"95": -5.5}, "allowed_token_ids": ["4"]})
    assert params.logit_bias == {95: -5.5} and params.allowed_token_ids == [4]
    params.check_token_ids(V)
    with pytest.raises(ValueError, match=r"logit_bias: 96 is not a token id \(an integer from 0"):
        SamplingParams(logit_bias={96: 1}).check_token_ids(V)
    with pytest.raises(ValueError, match=r"allowed_token_ids\[0\]: 96 is not a token id"):
        SamplingParams(allowed_token_ids=[96]).check_token_ids(V)

"""Sample and prompt log-probs through `LLM.generate` against HF transformers: the
log_softmax of the model's own logits on the same ids (fp32 tiny Llama), to 1e-4 absolute —
the chosen token's log-prob and rank, the top-N ids and values, for a batch mixing requests
of several lengths and settings, with chunked prefill and with prefix-cache hits around."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import TINY, hf_model, random_prompts
from pagedllm import LLM, RequestOutput, SamplingParams
from pagedllm.outputs import Logprob

TOL = 1e-4
MAX_NEW = 8
BUDGET = 16  # tokens per step: longer prompts are prefilled in chunks


@pytest.fixture(scope="module")
def oracle(checkpoints: dict[str, Path]) -> Any:
    return hf_model(checkpoints["llama"])


@pytest.fixture(scope="module")
def chunked(checkpoints: dict[str, Path]) -> LLM:
    return LLM(
        str(checkpoints["llama"]), dtype="float32", block_size=4, max_num_batched_tokens=BUDGET
    )


def hf_log_softmax(oracle: Any, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) float64: row j scores the token at position j + 1."""
    with torch.no_grad():
        return oracle(torch.tensor([ids])).logits[0].double().log_softmax(dim=-1)


def check_position(entry: dict[int, Logprob], ref: torch.Tensor, token: int, n: int) -> None:
    """One position's `{token id: Logprob}` against HF's log_softmax row `ref` (V,)."""
    assert token in entry
    chosen = entry[token]
    assert abs(chosen.logprob - ref[token].item()) < TOL
    # the rank counts the tokens more likely than the chosen one (exact but for near-ties)
    lp = ref[token].item()
    assert 1 + int((ref > lp + TOL).sum()) <= chosen.rank <= 1 + int((ref > lp - TOL).sum())
    if n == 0:
        assert list(entry) == [token]
        return
    top = sorted(((e.rank, tid, e.logprob) for tid, e in entry.items() if e.rank <= n))
    assert [r for r, _, _ in top] == list(range(1, n + 1))
    assert set(entry) == {tid for _, tid, _ in top} | {token}
    hf_vals, hf_ids = ref.topk(n)
    for (_, tid, value), hf_id, hf_val in zip(top, hf_ids.tolist(), hf_vals.tolist(), strict=True):
        assert abs(value - hf_val) < TOL  # the k-th largest value
        assert abs(ref[tid].item() - value) < TOL  # and the id it belongs to
        assert tid == hf_id or abs(ref[hf_id].item() - ref[tid].item()) < TOL  # a near-tie


def check_request(oracle: Any, out: RequestOutput, params: SamplingParams) -> None:
    prompt, c = out.prompt_token_ids, out.outputs[0]
    ref = hf_log_softmax(oracle, prompt + c.token_ids)
    if params.logprobs is None:
        assert c.logprobs is None and c.cumulative_logprob is None
    else:
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) > 0
        for j, (token, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            check_position(entry, ref[len(prompt) - 1 + j], token, params.logprobs)
        expected = sum(ref[len(prompt) - 1 + j, t].item() for j, t in enumerate(c.token_ids))
        assert c.cumulative_logprob == pytest.approx(expected, abs=TOL * len(c.token_ids))
    if params.prompt_logprobs is None:
        assert out.prompt_logprobs is None
    else:
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(prompt) and plp[0] is None
        for i in range(1, len(prompt)):
            entry = plp[i]
            assert entry is not None
            check_position(entry, ref[i - 1], prompt[i], params.prompt_logprobs)


def generate(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def chosen_ranks(out: RequestOutput) -> list[int]:
    c = out.outputs[0]
    assert c.logprobs is not None
    return [entry[t].rank for entry, t in zip(c.logprobs, c.token_ids, strict=True)]


def test_mixed_batch_with_chunked_prefill(chunked: LLM, oracle: Any) -> None:
    lengths = [9, 30, 4, 17, 6, 3 * BUDGET + 5]  # the last one takes four prefill steps
    prompts = [random_prompts(1, (n, n), TINY["vocab_size"], seed=n)[0] for n in lengths]
    base = dict(max_tokens=MAX_NEW, ignore_eos=True)
    params = [
        SamplingParams(temperature=0, logprobs=5, prompt_logprobs=5, **base),
        SamplingParams(temperature=0, logprobs=20, **base),
        SamplingParams(temperature=0, **base),  # none asked
        SamplingParams(temperature=0.9, seed=7, logprobs=3, **base),
        SamplingParams(temperature=0, logprobs=0, prompt_logprobs=0, **base),
        SamplingParams(temperature=0, logprobs=2, prompt_logprobs=20, **base),
    ]
    outs = generate(chunked, prompts, params)
    for out, p in zip(outs, params, strict=True):
        check_request(oracle, out, p)
    # greedy rows chose the most likely token; the seeded row did not always
    assert set(chosen_ranks(outs[1])) == {1} and max(chosen_ranks(outs[3])) > 1


def test_prompt_logprobs_complete_beside_prefix_hits(chunked: LLM, oracle: Any) -> None:
    shared = random_prompts(1, (24, 24), TINY["vocab_size"], seed=40)[0]
    tails = random_prompts(3, (3, 7), TINY["vocab_size"], seed=41)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    (first,) = generate(chunked, [shared + tails[0]], [greedy])  # caches the shared blocks
    asked = SamplingParams(
        temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5, prompt_logprobs=5
    )
    prompts = [shared + tails[1], shared + tails[2], shared + tails[0]]
    outs = generate(chunked, prompts, [asked, greedy, asked])
    assert outs[1].num_cached_tokens >= 20  # the cache is warm for requests that use it
    for out, p in zip(outs, [asked, greedy, asked], strict=True):
        check_request(oracle, out, p)
    assert outs[2].outputs[0].token_ids == first.outputs[0].token_ids

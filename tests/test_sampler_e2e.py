"""The sampler end to end through `LLM.generate` on the tiny Llama checkpoint: seeds alone and
in a batch, greedy rows beside random ones, n samples, and log-probabilities against HF's
forward."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import TINY, hf_greedy, hf_model, random_prompts
from pagedllm import LLM, RequestOutput, SamplingParams

MAX_NEW = 10


@pytest.fixture(scope="module")
def llm(checkpoints: dict[str, Path]) -> LLM:
    return LLM(str(checkpoints["llama"]))


@pytest.fixture(scope="module")
def oracle(checkpoints: dict[str, Path]) -> Any:
    return hf_model(checkpoints["llama"])


def generate(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def hf_log_softmax(oracle: Any, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) fp32: row j scores the token at position j + 1."""
    with torch.no_grad():
        return oracle(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def check_logprob_dict(entry: dict[int, Any], row: torch.Tensor, token: int, n: int) -> None:
    """One position's `{token id: Logprob}` against HF's log_softmax `row` (V,): the chosen
    token and the n most likely, values within 1e-4, ranks as HF's up to near-ties."""
    tol = 1e-4
    assert token in entry
    assert abs(entry[token].logprob - row[token].item()) < tol
    lp = row[token].item()
    assert 1 + int((row > lp + tol).sum()) <= entry[token].rank <= 1 + int((row > lp - tol).sum())
    top = {tid: e for tid, e in entry.items() if e.rank <= n}
    assert sorted(e.rank for e in top.values()) == list(range(1, n + 1))
    assert set(entry) == set(top) | {token}
    nth_largest = row.topk(n).values[-1].item()
    for tid, e in top.items():
        assert abs(e.logprob - row[tid].item()) < tol
        assert row[tid].item() >= nth_largest - tol  # one of the n largest


def test_e2e_seed_same_alone_and_in_batch(llm: LLM) -> None:
    prompts = random_prompts(5, (3, 30), TINY["vocab_size"], seed=11)
    target = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=MAX_NEW)
    others = [
        SamplingParams(temperature=1.0, max_tokens=MAX_NEW + 3),
        SamplingParams(temperature=0, max_tokens=4),
        SamplingParams(temperature=1.2, top_k=20, seed=8, repetition_penalty=1.3, max_tokens=6),
        SamplingParams(temperature=0.5, min_p=0.1, presence_penalty=0.5, n=2),
    ]
    mine, rest = prompts[0], prompts[1:]
    (alone,) = generate(llm, [mine], [target])
    batched = generate(llm, [rest[0], mine, *rest[1:]], [others[0], target, *others[1:]])
    swapped = generate(llm, [*rest[::-1], mine], [*others[::-1], target])
    for out in (batched[1], swapped[-1]):
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert out.outputs[0].text == alone.outputs[0].text
    assert len(alone.outputs[0].token_ids) == MAX_NEW or alone.outputs[0].finish_reason == "stop"
    (other_seed,) = generate(llm, [mine], [dataclasses.replace(target, seed=9)])
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_e2e_greedy_rows_unaffected_by_random_rows(llm: LLM, oracle: Any) -> None:
    prompts = random_prompts(6, (2, 25), TINY["vocab_size"], seed=12)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    randoms = [
        SamplingParams(temperature=1.0, max_tokens=MAX_NEW),
        SamplingParams(temperature=1.5, top_k=50, top_p=0.9, max_tokens=MAX_NEW),
        SamplingParams(temperature=0.7, min_p=0.05, max_tokens=MAX_NEW),
    ]
    params = [greedy if i % 2 == 0 else randoms[i // 2] for i in range(6)]
    outs = generate(llm, prompts, params)
    greedy_prompts = prompts[0::2]
    expected = hf_greedy(oracle, greedy_prompts, MAX_NEW, eos=None)
    assert [o.outputs[0].token_ids for o in outs[0::2]] == expected
    alone = generate(llm, greedy_prompts, [greedy] * 3)
    assert [o.outputs[0].text for o in outs[0::2]] == [o.outputs[0].text for o in alone]


def test_e2e_n_samples_with_seed(llm: LLM) -> None:
    prompt = random_prompts(1, (8, 8), TINY["vocab_size"], seed=13)
    params = SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=MAX_NEW, ignore_eos=True)
    (first,) = generate(llm, prompt, [params])
    assert [c.index for c in first.outputs] == [0, 1, 2]
    ids = [c.token_ids for c in first.outputs]
    assert all(len(x) == MAX_NEW for x in ids)
    assert len({tuple(x) for x in ids}) > 1
    (again,) = generate(llm, prompt, [params])
    assert [c.token_ids for c in again.outputs] == ids


def test_e2e_logprobs_match_hf(llm: LLM, oracle: Any) -> None:
    prompts = random_prompts(2, (5, 20), TINY["vocab_size"], seed=14)
    params = [
        SamplingParams(temperature=1.0, seed=3, logprobs=3, max_tokens=MAX_NEW),
        SamplingParams(temperature=0, logprobs=3, max_tokens=MAX_NEW, ignore_eos=True),
    ]
    outs = generate(llm, prompts, params)
    ranks = []
    for prompt, out in zip(prompts, outs, strict=True):
        c = out.outputs[0]
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        ref = hf_log_softmax(oracle, prompt + c.token_ids)
        chosen = []
        for j, (token, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            row = ref[len(prompt) - 1 + j]  # the logits that predicted output token j
            check_logprob_dict(entry, row, token, 3)
            chosen.append(entry[token].logprob)
            ranks.append(entry[token].rank)
        assert c.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-4)
    assert max(ranks) > 1  # the random row did not only pick top-1 tokens


@pytest.mark.parametrize("chunk", [None, 7])
def test_e2e_prompt_logprobs_match_hf(
    checkpoints: dict[str, Path], oracle: Any, chunk: int | None
) -> None:
    # chunk=7: prompts are prefilled over several steps, their logprobs gathered per chunk
    llm = LLM(str(checkpoints["llama"]), max_num_batched_tokens=chunk, block_size=4)
    prompts = random_prompts(2, (12, 30), TINY["vocab_size"], seed=15)
    params = SamplingParams(prompt_logprobs=2, max_tokens=2)
    outs = generate(llm, prompts, [params, params])
    for prompt, out in zip(prompts, outs, strict=True):
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(prompt) and plp[0] is None
        ref = hf_log_softmax(oracle, prompt)
        for i in range(1, len(prompt)):
            entry, row, token = plp[i], ref[i - 1], prompt[i]
            assert entry is not None
            check_logprob_dict(entry, row, token, 2)
    # the prompts' blocks are now cached: prompt logprobs must still cover every position
    again = generate(llm, prompts, [params, params])
    assert [o.prompt_logprobs for o in again] == [o.prompt_logprobs for o in outs]

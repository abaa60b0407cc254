"""Greedy parity with HF transformers on tiny random Llama / Qwen2 / Mistral checkpoints:
batched mixed lengths, chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import ARCHS, TINY, hf_greedy, hf_model, random_prompts
from pagedllm import LLM, SamplingParams

MAX_NEW = 24


def run(path: Path, prompts: list[list[int]], **knobs: Any) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), **knobs)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.prompt_token_ids for o in outs] == prompts  # input order kept
    llm.engine.check_integrity()
    assert llm.engine.stats().kv_blocks_used == 0
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def oracle(checkpoints: dict[str, Path]) -> dict[str, Any]:
    return {arch: hf_model(path) for arch, path in checkpoints.items()}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_batched_mixed_lengths(arch: str, checkpoints: dict[str, Path], oracle: dict) -> None:
    prompts = random_prompts(10, (1, 70), TINY["vocab_size"], seed=1)
    _, got = run(checkpoints[arch], prompts, enable_prefix_caching=False)
    assert got == hf_greedy(oracle[arch], prompts, MAX_NEW, eos=None)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_chunked_prefill(arch: str, checkpoints: dict[str, Path], oracle: dict) -> None:
    prompts = random_prompts(8, (20, 90), TINY["vocab_size"], seed=2)
    # a budget far below the prompt lengths: every prompt is split over several steps,
    # and decodes share steps with other requests' chunks
    _, got = run(checkpoints[arch], prompts, max_num_batched_tokens=13, block_size=8)
    assert got == hf_greedy(oracle[arch], prompts, MAX_NEW, eos=None)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_prefix_cache_hits(arch: str, checkpoints: dict[str, Path], oracle: dict) -> None:
    shared = random_prompts(1, (40, 40), TINY["vocab_size"], seed=3)[0]
    tails = random_prompts(8, (1, 20), TINY["vocab_size"], seed=4)
    prompts = [shared + t for t in tails] + [shared[:17]]
    llm = LLM(str(checkpoints[arch]), block_size=4, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(
        oracle[arch], prompts, MAX_NEW, eos=None
    )
    # the first request computes the shared prefix; later ones find its 10 blocks cached
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 40 for o in outs[2:8])
    assert llm.engine.stats().prefix_cache_hits >= 6 * 40
    llm.engine.check_integrity()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_preemption(arch: str, checkpoints: dict[str, Path], oracle: dict) -> None:
    # Mistral frees blocks out of its 24-token window: from short prompts its requests grow
    # and preempt
    lengths = (1, 8) if arch == "mistral" else (10, 40)
    prompts = random_prompts(8, lengths, TINY["vocab_size"], seed=5)
    # 24 blocks of 4 tokens: room for ~1.5 full requests at a time
    llm, got = run(checkpoints[arch], prompts, block_size=4, num_kv_blocks=24)
    assert llm.engine.stats().num_preemptions > 0
    assert got == hf_greedy(oracle[arch], prompts, MAX_NEW, eos=None)


def test_preemption_without_prefix_cache(checkpoints: dict[str, Path], oracle: dict) -> None:
    prompts = random_prompts(8, (10, 40), TINY["vocab_size"], seed=6)
    llm, got = run(
        checkpoints["llama"],
        prompts,
        block_size=4,
        num_kv_blocks=24,
        enable_prefix_caching=False,
        max_num_batched_tokens=16,
    )
    assert llm.engine.stats().num_preemptions > 0
    assert got == hf_greedy(oracle["llama"], prompts, MAX_NEW, eos=None)


def test_eos_stops_like_hf(checkpoints: dict[str, Path], oracle: dict) -> None:
    prompts = random_prompts(12, (5, 30), TINY["vocab_size"], seed=7)
    ref = hf_greedy(oracle["qwen2"], prompts, MAX_NEW, eos=None)
    # make a token the model really emits the EOS: some requests must stop early on it
    eos = ref[0][3]
    ref_eos = hf_greedy(oracle["qwen2"], prompts, MAX_NEW, eos=eos)
    llm = LLM(str(checkpoints["qwen2"]))
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[eos]),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == ref_eos
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons == ["stop" if r[-1] == eos else "length" for r in ref_eos]
    assert "stop" in reasons


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_each_attention_backend(
    arch: str, backend: str, checkpoints: dict[str, Path], oracle: dict
) -> None:
    """The pure-PyTorch reference and the C++ decode kernel, each forced, with chunked prefill
    (mixed decode + prefill steps) and a sliding window (mistral)."""
    prompts = random_prompts(8, (10, 60), TINY["vocab_size"], seed=8)
    llm, got = run(checkpoints[arch], prompts, attention_backend=backend, max_num_batched_tokens=20)
    assert llm.engine.runner.backend.name == backend
    assert got == hf_greedy(oracle[arch], prompts, MAX_NEW, eos=None)

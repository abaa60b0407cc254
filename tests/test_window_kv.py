"""Blocks freed by the sliding window, end to end: every attention backend ignores the entries
of a block table that fell out of the window (whatever block they name), and the engine on
the tiny Mistral checkpoint (every layer windowed, 24 tokens) serves long generations in a KV
pool that could not hold them otherwise, with HF transformers' greedy tokens. Model-free
scheduler tests: test_scheduler_window.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from test_triton_kernels import make_step, to_head_major

from conftest import TINY, hf_greedy, hf_model, random_prompts
from pagedllm import SamplingParams
from pagedllm.config import CacheConfig, EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.layers.attention import StepInputs, cpu_kernels
from pagedllm.layers.attention.base import AttnLayer
from pagedllm.layers.attention.torch_ref import TorchAttentionBackend

WINDOW = 12
# decodes and prefill chunks whose first query is before, at and well past the window
REQUESTS = [(40, 1), (45, 1), (11, 1), (5, 1), (30, 8), (17, 16), (0, 9)]
BS = 8


def test_only_a_model_with_every_layer_windowed_frees_blocks() -> None:
    assert CacheConfig.window_of((24, 24)) == 24
    assert CacheConfig.window_of((8, 16)) == 16  # the widest window
    assert CacheConfig.window_of((12, None, 12)) is None  # Gemma 2 / 3: a global layer
    assert CacheConfig.window_of((None, None)) is None


# --- the backends never use a dropped entry ------------------------------------------------


def poisoned(step: StepInputs, poison: int) -> StepInputs:
    """The step with every entry out of its request's window pointing at block `poison`."""
    tables = step.block_tables.clone()
    for r, ctx in enumerate(step.context_lens):
        first = ctx - (step.query_start_loc[r + 1] - step.query_start_loc[r])
        tables[r, : max(0, first - WINDOW + 1) // BS] = poison
    return StepInputs(**{**vars(step), "block_tables": tables})


def inputs(num_blocks: int, poison_value: float) -> tuple[torch.Tensor, ...]:
    """A cache of `num_blocks` random blocks plus one filled with `poison_value`; q and kv."""
    gen = torch.Generator().manual_seed(0)
    n = sum(new for _, new in REQUESTS)
    cache = torch.randn(num_blocks + 1, BS, 2, 2, 64, generator=gen)
    cache[num_blocks] = poison_value
    qkv = torch.randn(n, 4 + 2 * 2, 64, generator=gen)
    return cache, qkv[:, :4], qkv[:, 4:].view(n, 2, 2, 64)


def test_the_reference_backend_masks_what_it_gathers() -> None:
    # it gathers whole tables: a dropped entry must name a valid block (any: it is masked)
    step, num_blocks = make_step(REQUESTS, BS)
    cache, q, kv = inputs(num_blocks, 1e4)
    layer = AttnLayer(0.125, WINDOW)
    ref = TorchAttentionBackend()
    expected = ref.forward(q, kv, cache.clone(), ref.build_metadata(step), layer)
    bad = poisoned(step, num_blocks)
    assert not torch.equal(bad.block_tables, step.block_tables)
    got = ref.forward(q, kv, cache.clone(), ref.build_metadata(bad), layer)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_the_cpu_kernel_never_reads_a_dropped_block() -> None:
    if cpu_kernels.load_kernels() is None:
        pytest.skip("the C++ CPU kernel is unavailable")
    decodes = [(p, 1) for p, n in REQUESTS if n == 1]
    step, num_blocks = make_step(decodes, BS)
    cache, q, _ = inputs(num_blocks, float("nan"))
    q = q[: len(decodes)]
    lens = torch.tensor(step.context_lens)
    outs = [
        cpu_kernels.paged_decode_attention(
            torch.empty_like(q), q, cache, s.block_tables, lens, 0.125, WINDOW
        )
        for s in (step, poisoned(step, num_blocks))
    ]
    assert not outs[1].isnan().any()
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)


def test_the_triton_kernels_never_read_a_dropped_block() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("the triton package is missing")
    from pagedllm.layers.attention.triton_backend import TritonAttentionBackend
    from pagedllm.layers.attention.triton_launch import KernelConfig

    step, num_blocks = make_step(REQUESTS, BS)
    cache, q, kv = inputs(num_blocks, float("nan"))
    layer = AttnLayer(0.125, WINDOW)
    # tiles of 16: the windows start inside tiles, and tiles start before the windows
    backend = TritonAttentionBackend(
        KernelConfig(decode_block_n=16, prefill_block_m=16, prefill_block_n=16)
    )
    outs = []
    for s in (step, poisoned(step, num_blocks)):
        meta = backend.build_metadata(s)
        outs.append(backend.forward(q, kv, to_head_major(cache), meta, layer))
    assert not outs[1].isnan().any()
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)


# --- the engine on the tiny Mistral ------------------------------------------------------------

MAX_NEW = 120
# 8-token blocks, chunks of at most 16 tokens: a request holds at most
# ceil((24 - 1 + 16) / 8) + 1 = 6 blocks; without dropping ~19 (prompt + 120 tokens)
TIGHT = dict(block_size=8, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def mistral(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["mistral"]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    # a shared 40-token prefix: later requests hit the blocks of its last window
    shared = random_prompts(1, (40, 40), TINY["vocab_size"], seed=11)[0]
    return [shared + t for t in random_prompts(4, (1, 10), TINY["vocab_size"], seed=12)]


@pytest.fixture(scope="module")
def expected(mistral: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(hf_model(mistral), prompts, MAX_NEW, eos=None)


def create(path: Path, drop: bool = True, **knobs: Any) -> LLMEngine:
    config = EngineConfig.create(path, dtype="float32", free_out_of_window_blocks=drop, **knobs)
    assert config.cache.sliding_window == (24 if drop else None)
    return LLMEngine(config)


def generate(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs in prompt order; checks that every block is free again."""
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = list(out.outputs[0].token_ids)
    engine.check_integrity()
    assert engine.stats().kv_blocks_used == 0
    return [outs[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_pool_too_small_for_one_request_serves_them_all(
    mistral: Path, prompts: list[list[int]], expected: list[list[int]], backend: str
) -> None:
    knobs = dict(TIGHT, num_kv_blocks=12, attention_backend=backend)
    keep = create(mistral, drop=False, **knobs)
    with pytest.raises(ValueError, match="KV blocks; the pool has 12"):
        keep.add_request("0", prompts[0], SamplingParams(max_tokens=MAX_NEW))
    keep.close()

    engine = create(mistral, **knobs)
    assert generate(engine, prompts) == expected
    stats = engine.stats()
    assert stats.kv_blocks_peak <= 12
    assert stats.kv_blocks_freed_by_window >= len(prompts) * 12
    assert stats.prefix_cache_hits > 0
    engine.close()


@pytest.mark.parametrize("caching", [False, True])
def test_dropping_saves_preemptions(
    mistral: Path, prompts: list[list[int]], expected: list[list[int]], caching: bool
) -> None:
    # 24 blocks: one request of ~19 blocks fits, four do not
    knobs = dict(TIGHT, num_kv_blocks=24, enable_prefix_caching=caching)
    preemptions, peaks = {}, {}
    for drop in (False, True):
        engine = create(mistral, drop=drop, **knobs)
        assert generate(engine, prompts) == expected
        preemptions[drop] = engine.stats().num_preemptions
        peaks[drop] = engine.stats().kv_blocks_peak
        engine.close()
    assert preemptions[True] == 0 < preemptions[False]
    assert peaks[True] < peaks[False]

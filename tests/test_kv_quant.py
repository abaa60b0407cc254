"""Quantized KV caches (kv_cache_dtype): the int8 rows and fp8 casts of the reference path
against their definitions, the C++ int8 write and decode kernel against the reference path
over the same bytes, the pool sizing, and the engine end to end (chunked prefill, prefix
hits, preemption) against HF's unquantized model, teacher-forced."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_cpu_attention import (
    ATOL,
    compare_backends,
    num_threads,
    plain_attention,
    random_tables,
)

from conftest import hf_model, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.config import ConfigError, EngineConfig
from pagedllm.kv_cache_dtype import bytes_per_token_layer, check_kv_cache_dtype
from pagedllm.layers.attention import cpu_kernels, kv_quant
from pagedllm.layers.attention.base import AttnLayer


def test_names_are_vllms() -> None:
    assert check_kv_cache_dtype(None) == "auto"
    assert check_kv_cache_dtype("fp8") == check_kv_cache_dtype("FP8_E4M3") == "fp8_e4m3"
    assert check_kv_cache_dtype("fp8_e5m2") == "fp8_e5m2"
    assert check_kv_cache_dtype("int8_per_token_head") == check_kv_cache_dtype("int8") == "int8"
    with pytest.raises(ConfigError, match="int8_per_token_head"):
        check_kv_cache_dtype("q8_0")


def test_int8_rows_round_to_the_nearest_step() -> None:
    """Each row's scale is its absmax / 127; each value comes back within half a step."""
    x = torch.randn(5, 2, 3, 64) * torch.logspace(-3, 2, 5)[:, None, None, None]
    x[0, 0, 0] = 0  # an all-zero row: zeros back, no NaN
    rows = kv_quant.quantize_int8(x)
    assert rows.shape == (5, 2, 3, 68) and rows.dtype == torch.int8
    scale = x.abs().amax(-1, keepdim=True) / 127
    back = kv_quant.dequantize_int8(rows, torch.float32)
    assert torch.equal(back[0, 0, 0], torch.zeros(64))
    assert ((back - x).abs() <= scale / 2 * (1 + 1e-6)).all()
    assert (rows[..., :64].abs() <= 127).all()
    assert rows[..., :64].abs().amax(-1)[1:].eq(127).all()  # the absmax lands on +-127


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_write_and_gather_are_a_saturating_cast(dtype: torch.dtype) -> None:
    cache = torch.zeros(4, 8, 2, 2, 16, dtype=dtype)
    kv = torch.randn(6, 2, 2, 16) * 3
    kv[0, 0, 0, 0] = 1e6  # beyond the format: saturates, no NaN
    slots = torch.tensor([3, 9, 10, 17, 30, 31])
    kv_quant.write(cache, slots, kv)
    blocks = kv_quant.gather_blocks(cache, torch.arange(4), torch.float32).view(-1, 2, 2, 16)
    top = torch.finfo(dtype).max
    assert torch.equal(blocks[slots], kv.clamp(-top, top).to(dtype).float())
    assert blocks[slots][0, 0, 0, 0] == top


@pytest.mark.parametrize("dtype", list(ATOL))
def test_cpp_int8_write_is_the_reference_bits(dtype: torch.dtype) -> None:
    n, heads, kv_heads, head_dim = 9, 6, 2, 64
    qkv = (torch.randn(n, heads + 2 * kv_heads, head_dim) * 4).to(dtype)
    kv = qkv[:, heads:].view(n, 2, kv_heads, head_dim)
    slots = torch.randperm(5 * 8)[:n]
    cache = torch.randint(-127, 128, (5, 8, 2, kv_heads, head_dim + 4), dtype=torch.int8)
    expected = cache.clone()
    kv_quant.write(expected, slots, kv)
    cpu_kernels.write_kv(kv, cache, slots)
    assert torch.equal(cache, expected)


def int8_cache(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A random int8 cache of rows (..., head_dim + 4), quantized from normal values."""
    return kv_quant.quantize_int8(torch.randn(shape, generator=gen))


@pytest.mark.parametrize("dtype", list(ATOL))
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpp_int8_decode_matches_plain_attention(
    dtype: torch.dtype, group: int, head_dim: int, threads: int
) -> None:
    """The kernel over an int8 cache against fp32 attention over its dequantized values (one
    request on 2 threads: the keys cut over both)."""
    block_size, kv_heads = 8, 2
    lens = [1, 8, 9, 45, 70] if threads == 1 else [299]
    gen = torch.Generator().manual_seed(head_dim + group)
    tables, num_blocks = random_tables(lens, block_size, gen)
    cache = int8_cache((num_blocks, block_size, 2, kv_heads, head_dim), gen)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    out = torch.empty(q.shape, dtype=dtype)
    ctx = torch.tensor(lens)
    with num_threads(threads):
        cpu_kernels.paged_decode_attention(out, q, cache, tables, ctx, head_dim**-0.5, None)
    values = kv_quant.dequantize_int8(cache, torch.float32)
    expected = plain_attention(q, values, tables, lens, head_dim**-0.5, None)
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
def test_cpu_backend_int8_matches_reference(dtype: torch.dtype, window: int | None) -> None:
    """Decodes and prefill chunks over an int8 cache: the cpu backend (C++ write and decode)
    against the reference backend: the same cache bytes, the same outputs up to rounding."""
    layer = AttnLayer(0.5, window, 3.0)  # soft-capped: scores ~4 sigma wide, a cap of 3
    compare_backends([(0, 1), (8, 1), (20, 1), (11, 9), (0, 5)], dtype, layer, quantized=True)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "requests",
    [[(0, 37)], [(45, 20), (16, 16)], [(3, 1), (70, 1), (40, 17), (0, 9)]],
    ids=["first-chunk", "after-prefixes", "mixed"],
)
def test_cpu_backend_int8_prefill_runs_on_the_kernel(
    requests: list[tuple[int, int]], threads: int
) -> None:
    """Prefill chunks over an int8 cache, a first one, ones after a cached prefix (an earlier
    chunk, or a prefix-cache hit: the same blocks) and beside decodes, with attention sinks:
    the C++ kernel, each token attending its causal context, against the reference backend;
    the reference path's metadata is never built."""
    sinks = torch.linspace(-1.0, 2.0, 6)
    with num_threads(threads):
        meta = compare_backends(
            requests, torch.float32, AttnLayer(0.3, sinks=sinks), quantized=True
        )
    assert "ref" not in vars(meta)


def test_pool_holds_more_tokens_in_the_same_memory(tmp_path: Path) -> None:
    """Head dim 64 (SmolLM2's): int8 rows with their scales take 68 bytes, 16-bit ones 128,
    fp32 ones 256; the budget's block count follows."""
    assert bytes_per_token_layer("int8", torch.bfloat16, 2 * 3 * 64, 64) == 2 * 3 * 68
    assert bytes_per_token_layer("fp8_e4m3", torch.float32, 384, 64) == 384
    from conftest import make_checkpoint

    path = make_checkpoint(tmp_path / "m", "llama", num_attention_heads=2, num_key_value_heads=1,
                           hidden_size=128)  # fmt: skip
    blocks = {
        (kind, dtype): EngineConfig.create(
            path,
            dtype=dtype,
            kv_cache_dtype=kind,
            kv_cache_memory=1 << 22,
            max_num_seqs=4096,
            device="cpu",
        ).cache.num_kv_blocks
        for kind in ("auto", "int8", "fp8")
        for dtype in ("float32", "bfloat16")
    }
    assert blocks["int8", "bfloat16"] >= 1.85 * blocks["auto", "bfloat16"]
    assert blocks["int8", "float32"] >= 3.7 * blocks["auto", "float32"]
    assert blocks["fp8", "bfloat16"] >= 2 * blocks["auto", "bfloat16"]


def test_what_cannot_run_is_refused() -> None:
    from pagedllm.kv_cache_dtype import check_fp8_e4m3, check_supported

    with pytest.raises(ConfigError, match="MLA"):
        check_supported("int8", "cpu", latent=True)
    check_supported("int8", "cpu", latent=False)
    with pytest.raises(ConfigError, match="CPU only"):
        check_supported("int8", "cuda:0", latent=False)
    with pytest.raises(ConfigError, match=r"8\.9 or newer \(this one: 8\.0\).*fp8_e5m2"):
        check_fp8_e4m3((8, 0))
    check_fp8_e4m3((8, 9))
    check_fp8_e4m3((10, 0))


def teacher_forced_agreement(
    model: object, prompts: list[list[int]], outputs: list[list[int]]
) -> float:
    """The share of generated tokens the unquantized HF model, fed prompt + output, ranks
    first at their positions."""
    same = total = 0
    for p, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([p + out])).logits[0]  # type: ignore[operator]
        best = logits[len(p) - 1 : len(p) + len(out) - 1].argmax(-1).tolist()
        same += sum(a == b for a, b in zip(best, out, strict=True))
        total += len(out)
    return same / total


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_engine_every_path(checkpoints: dict[str, Path], kind: str) -> None:
    """A quantized cache through the engine: chunked prefill, prefix-cache hits and
    preemption (int8: on the C++ kernels; fp8: the reference path, emulated) give the
    reference path's tokens (unchunked, uncached, room for all); those agree with HF's
    unquantized model, teacher-forced, on >= 95 % of tokens."""
    path = checkpoints["llama"]
    base = random_prompts(6, (20, 60), 384, seed=3)
    prompts = base + [base[0][:30] + p[:10] for p in base[1:4]]  # shared prefixes: hits
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(**knobs: object) -> tuple[list[list[int]], LLM]:
        with LLM(str(path), dtype="float32", device="cpu", kv_cache_dtype=kind, **knobs) as llm:
            ids = [{"prompt_token_ids": p} for p in prompts]
            outs = [list(o.outputs[0].token_ids) for o in llm.generate(ids, params, False)]
            llm.engine.check_integrity()
            return outs, llm

    reference, _ = run(attention_backend="torch", enable_prefix_caching=False)
    fast, llm = run(num_kv_blocks=14, max_num_batched_tokens=32, block_size=8)
    stats = llm.engine.stats()
    assert stats.kv_cache_dtype == kind and stats.kv_token_capacity == 14 * 8
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert fast == reference
    assert teacher_forced_agreement(hf_model(path), prompts, reference) >= 0.95


def test_int8_cache_over_two_ranks(checkpoints: dict[str, Path]) -> None:
    """Tensor parallelism (CPU, gloo): each rank quantizes and attends its own KV head; the
    greedy tokens are one rank's with the same cache (scales are per head, so the shards
    hold the same rows)."""
    path = str(checkpoints["llama"])
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, (10, 40), 384, seed=5)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = []
    for world in (1, 2):
        with LLM(path, dtype="float32", device="cpu", kv_cache_dtype="int8",
                 tensor_parallel_size=world) as llm:  # fmt: skip
            assert llm.engine.stats().kv_cache_dtype == "int8"
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, False)])
    assert outs[0] == outs[1]

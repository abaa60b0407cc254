"""The C++ CPU paged decode kernel and the `cpu` backend against plain PyTorch attention and
the reference backend. The first test run compiles the kernel (about a minute)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.utils.cpp_extension import is_ninja_available

from pagedllm.layers.attention import StepInputs, cpu_kernels, kv_quant
from pagedllm.layers.attention.base import AttnLayer
from pagedllm.layers.attention.cpu_backend import CpuAttentionBackend
from pagedllm.layers.attention.torch_ref import TorchAttentionBackend

pytestmark = [
    pytest.mark.skipif(
        shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler found"
    ),
    pytest.mark.skipif(not is_ninja_available(), reason="ninja missing: pip install ninja"),
]

# bf16/fp16: the kernel accumulates in fp32 like the oracle, the rest is output rounding
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


# soft-capped attention: a scale that makes the scores of random q, k ~4 sigma wide, so that a
# cap of 3 changes them a lot
CAPPED = AttnLayer(scale=0.5, softcap=3.0)


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cpu_kernels.load_kernels() is not None, "kernel build failed (see the log)"


@contextmanager
def num_threads(n: int) -> Iterator[None]:
    """The kernels' threads: 1 runs the (request, KV head) passes; more with fewer tasks than
    twice the threads cut each request's keys into runs (flash-decoding)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def random_tables(
    lens: list[int], block_size: int, gen: torch.Generator, spare: int = 7
) -> tuple[torch.Tensor, int]:
    """Shuffled, non-contiguous block tables (padded with 0) and the pool size they need."""
    counts = [-(-n // block_size) for n in lens]
    num_blocks = sum(counts) + spare
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(max(counts), 1), dtype=torch.int64)
    used = 0
    for r, c in enumerate(counts):
        tables[r, :c] = ids[used : used + c]
        used += c
    return tables, num_blocks


def plain_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: list[int],
    scale: float,
    window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Softmax attention in fp32, one request at a time, keys looked up slot by slot; the
    scaled scores capped as cap * tanh(s / cap) with a soft-cap."""
    block_size, kv_heads = kv_cache.shape[1], kv_cache.shape[3]
    group = q.shape[1] // kv_heads
    slots_kv = kv_cache.flatten(0, 1).float()
    out = torch.empty(q.shape)
    for r, n in enumerate(lens):
        pos = torch.arange(max(0, n - window) if window else 0, n)
        kv = slots_kv[tables[r, pos // block_size] * block_size + pos % block_size]
        k, v = kv[:, 0].repeat_interleave(group, 1), kv[:, 1].repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", q[r].float(), k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        out[r] = torch.einsum("ht,thd->hd", scores.softmax(-1), v)
    return out


def run_kernel(
    lens: list[int],
    block_size: int,
    head_dim: int,
    group: int,
    dtype: torch.dtype,
    window: int | None = None,
    kv_heads: int = 2,
    softcap: float | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, oracle output) on random inputs; q is a strided view of a qkv buffer.
    `scale`: head_dim ** -0.5 by default."""
    gen = torch.Generator().manual_seed(sum(lens) + block_size + head_dim + group)
    tables, num_blocks = random_tables(lens, block_size, gen)
    shape = (num_blocks, block_size, 2, kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=gen).to(dtype)
    heads = kv_heads * group
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    q, scale = qkv[:, :heads], head_dim**-0.5 if scale is None else scale
    out = torch.empty(q.shape, dtype=dtype)
    ctx = torch.tensor(lens, dtype=torch.int64)
    cpu_kernels.paged_decode_attention(out, q, kv_cache, tables, ctx, scale, window, softcap)
    return out, plain_attention(q, kv_cache, tables, lens, scale, window, softcap)


@pytest.mark.parametrize("dtype", list(ATOL))
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_kernel_matches_plain_attention(
    block_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    # ragged: 1 token, exactly one block, one past a block boundary, several tiles of keys
    bs = block_size
    lens = [1, bs, bs + 1, 3 * bs + 5, 37, 70]
    out, expected = run_kernel(lens, block_size, head_dim, group, dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", list(ATOL))
@pytest.mark.parametrize("window", [1, 5, 40])
def test_kernel_sliding_window(window: int, dtype: torch.dtype) -> None:
    # contexts shorter than, equal to and longer than the window
    lens = [1, 4, 5, 6, 40, 41, 100]
    out, expected = run_kernel(lens, 8, 64, 3, dtype, window=window)
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("dtype", list(ATOL))
def test_kernel_cuts_keys_over_threads_at_batch_one(threads: int, dtype: torch.dtype) -> None:
    # fewer (request, KV head) tasks than twice the threads: each request's keys are cut into
    # runs (one per thread, a tile of keys at least), their softmax sums merged after
    cases = [([300], None, 64), ([70, 0], None, 128), ([1000], 100, 64), ([33, 97], 40, 80)]
    with num_threads(threads):
        for lens, window, head_dim in cases:
            out, expected = run_kernel(lens, 16, head_dim, 3, dtype, window=window, kv_heads=1)
            torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("window", [None, 5, 100])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_softcap(
    threads: int, window: int | None, head_dim: int, dtype: torch.dtype
) -> None:
    # 1 thread: each pass attends its (request, KV head) tasks; 2 threads and one request of
    # one KV head: its keys cut into two runs (but for window 5: too few keys to cut)
    lens, kv_heads = ([1, 8, 37, 70, 150], 2) if threads == 1 else ([300], 1)
    args = (lens, 16, head_dim, 3, dtype, window, kv_heads)
    with num_threads(threads):
        out, expected = run_kernel(*args, softcap=CAPPED.softcap, scale=CAPPED.scale)
        uncapped, _ = run_kernel(*args, scale=CAPPED.scale)
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=0)
    assert (out.float() - uncapped.float()).abs().max() > 10 * ATOL[dtype], "the cap is lost"


def test_kernel_other_head_dims() -> None:
    for head_dim in (16, 80, 256):
        out, expected = run_kernel([3, 50], 16, head_dim, 2, torch.float32, kv_heads=3)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_output_rounds_like_torch(dtype: torch.dtype) -> None:
    # zero queries, two keys: the output is (v0 + v1) / 2, exact in fp32, then rounded
    values = (torch.randn(2, 64) * 100).to(dtype)
    values[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    kv_cache = torch.zeros(1, 2, 2, 1, 64, dtype=dtype)
    kv_cache[0, :, 1, 0] = values
    out = torch.empty(1, 1, 64, dtype=dtype)
    q, tables, ctx = torch.zeros(1, 1, 64, dtype=dtype), torch.tensor([[0]]), torch.tensor([2])
    cpu_kernels.paged_decode_attention(out, q, kv_cache, tables, ctx, 1.0)
    expected = ((values[0].float() + values[1].float()) * 0.5).to(dtype)
    torch.testing.assert_close(out[0, 0], expected, atol=0, rtol=0, equal_nan=True)


def test_kernel_empty_context_gives_zeros() -> None:
    out, _ = run_kernel([0, 5], 4, 64, 2, torch.float32)
    assert out[0].eq(0).all() and out[1].abs().sum() > 0


def test_kernel_rejects_bad_inputs() -> None:
    kv_cache = torch.zeros(4, 8, 2, 2, 64)
    q, out = torch.zeros(1, 4, 64), torch.empty(1, 4, 64)
    ctx = torch.tensor([9])
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.paged_decode_attention(out, q, kv_cache, torch.tensor([[0, 4]]), ctx, 1.0)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        cpu_kernels.paged_decode_attention(out, q, kv_cache, torch.tensor([[0]]), ctx, 1.0)
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        cpu_kernels.paged_decode_attention(
            out, q, kv_cache, torch.tensor([[0, 1]]), ctx, 1.0, softcap=-1.0
        )
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_kernels.paged_decode_attention(
            out, q.bfloat16(), kv_cache, torch.tensor([[0, 1]]), ctx, 1.0
        )
    assert not cpu_kernels.supports(torch.zeros(1, 4, 72), torch.zeros(4, 8, 2, 2, 72))


@pytest.mark.parametrize("dtype", list(ATOL))
def test_write_kv_matches_index_copy(dtype: torch.dtype) -> None:
    """The keys and values of a qkv slice (token rows `heads + 2 kv_heads` apart) land in their
    slots exactly as index_copy_ puts them; every other slot is untouched."""
    n, heads, kv_heads, head_dim = 7, 6, 2, 64
    qkv = torch.randn(n, heads + 2 * kv_heads, head_dim).to(dtype)
    kv = qkv[:, heads:].view(n, 2, kv_heads, head_dim)
    slots = torch.randperm(5 * 8)[:n]
    cache = torch.randn(5, 8, 2, kv_heads, head_dim).to(dtype)
    expected = cache.clone()
    expected.view(-1, 2, kv_heads, head_dim).index_copy_(0, slots, kv)
    cpu_kernels.write_kv(kv, cache, slots)
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.write_kv(kv, cache, torch.full((n,), 40))
    # a layout it does not handle (keys and values not side by side): PyTorch's copy
    kv_t = kv.transpose(2, 3).contiguous().transpose(2, 3)
    cpu_kernels.write_kv(kv_t, cache, slots.flip(0))
    expected.view(-1, 2, kv_heads, head_dim).index_copy_(0, slots.flip(0), kv)
    assert torch.equal(cache, expected)


def make_step(
    requests: list[tuple[int, int]],
    block_size: int,
    num_decodes: int | None = None,
    seed: int = 0,
) -> tuple[StepInputs, int]:
    """A step over `requests` = [(cached prefix, new tokens)] with shuffled, non-contiguous
    block tables, as the model runner builds it (decodes first: by default the requests
    before the first one with several new tokens); and the pool size."""
    gen = torch.Generator().manual_seed(seed)
    lens = [p + n for p, n in requests]
    tables, num_blocks = random_tables(lens, block_size, gen)
    positions = torch.cat([torch.arange(p, p + n) for p, n in requests])
    owner = torch.cat([torch.full((n,), r) for r, (_, n) in enumerate(requests)])
    slots = tables[owner, positions // block_size] * block_size + positions % block_size
    starts = [0]
    for _, n in requests:
        starts.append(starts[-1] + n)
    if num_decodes is None:
        num_decodes = next((r for r, (_, n) in enumerate(requests) if n > 1), len(requests))
    step = StepInputs(
        input_ids=torch.zeros(len(positions), dtype=torch.int64),
        positions=positions,
        slot_mapping=slots,
        query_start_loc=starts,
        context_lens=lens,
        block_tables=tables,
        num_decodes=num_decodes,
        logits_indices=torch.tensor(starts[1:]) - 1,
        block_size=block_size,
    )
    return step, num_blocks


def compare_backends(
    requests: list[tuple[int, int]],
    dtype: torch.dtype,
    layer: AttnLayer | None = None,
    head_dim: int = 64,
    kv_heads: int = 2,
    quantized: bool = False,
) -> object:
    """The cpu backend against the reference one, on `layer` (default: head_dim ** -0.5, no
    window, no soft-cap); `quantized`: over an int8 cache (kv_cache_dtype.py). Returns the cpu
    backend's metadata of the step."""
    block_size, heads = 8, 3 * kv_heads
    layer = layer or AttnLayer(head_dim**-0.5)
    step, num_blocks = make_step(requests, block_size)
    gen = torch.Generator().manual_seed(1)
    n = len(step.positions)
    cache = torch.randn(num_blocks, block_size, 2, kv_heads, head_dim, generator=gen).to(dtype)
    if quantized:
        cache = kv_quant.quantize_int8(cache)
    qkv = torch.randn(n, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    q, kv = qkv[:, :heads], qkv[:, heads:].view(n, 2, kv_heads, head_dim)
    outs, caches = [], []
    for backend in (TorchAttentionBackend(), CpuAttentionBackend()):
        layer_cache = cache.clone()
        meta = backend.build_metadata(step)
        outs.append(backend.forward(q, kv, layer_cache, meta, layer))
        caches.append(layer_cache)
    assert torch.equal(caches[0], caches[1])
    assert outs[1].shape == (n, heads, head_dim) and outs[1].dtype == dtype
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=ATOL[dtype], rtol=0)
    return meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, CAPPED.softcap])
@pytest.mark.parametrize("window", [None, 6])
def test_backend_mixed_batch_matches_reference(
    dtype: torch.dtype, window: int | None, softcap: float | None
) -> None:
    # 3 decodes (one on its first token), then two prefill chunks (one with a cached prefix)
    layer = AttnLayer(CAPPED.scale if softcap else 64**-0.5, window, softcap)
    compare_backends([(0, 1), (8, 1), (20, 1), (11, 9), (0, 5)], dtype, layer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 70])
@pytest.mark.parametrize("threads", [1, 2])
def test_backend_softcap_decodes_match_reference(
    threads: int, window: int | None, dtype: torch.dtype
) -> None:
    # decodes only, GQA 3:1: 1 thread, three requests (per-head passes); 2 threads, one request
    # of one KV head with keys enough to be cut over both (the split path)
    requests, kv_heads = ([(5, 1), (40, 1), (150, 1)], 2) if threads == 1 else ([(299, 1)], 1)
    with num_threads(threads):
        compare_backends(requests, dtype, CAPPED._replace(window=window), kv_heads=kv_heads)


@pytest.mark.parametrize("requests", [[(3, 1), (16, 1)], [(0, 4)], [(5, 7), (0, 3)]])
def test_backend_decodes_only_or_prefills_only(requests: list[tuple[int, int]]) -> None:
    compare_backends(requests, torch.float32)


def test_backend_falls_back_for_unsupported_head_dim() -> None:
    compare_backends([(9, 1), (4, 3)], torch.float32, CAPPED, head_dim=72)


def test_disabled_kernel_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CPU_KERNEL", "0")
    monkeypatch.setattr(cpu_kernels, "_state", {})
    assert not CpuAttentionBackend().kernel_available
    with pytest.raises(RuntimeError, match="unavailable"):
        run_kernel([3], 4, 64, 1, torch.float32)
    compare_backends([(9, 1), (4, 3)], torch.float32, CAPPED)


def test_decode_step_builds_no_reference_metadata() -> None:
    """A step of decodes that the kernels run whole needs none of the reference path's masks:
    they are not built (six tensor ops a step); a step the reference path runs builds them,
    the same as the reference backend's."""
    backend = CpuAttentionBackend()
    decodes, _ = make_step([(3, 1), (16, 1)], 8)
    meta = backend.build_metadata(decodes)
    assert backend.decode_batch(meta) is not None and "ref" not in vars(meta)
    mixed, _ = make_step([(3, 1), (11, 9)], 8)
    meta = backend.build_metadata(mixed)
    assert backend.decode_batch(meta) is None
    expected = TorchAttentionBackend().build_metadata(mixed)
    assert torch.equal(meta.ref.masks_for(None)[0], expected.masks_for(None)[0])
    assert meta.prefill_ref.num_decodes == 0 and len(meta.prefill_ref.prefills) == 1

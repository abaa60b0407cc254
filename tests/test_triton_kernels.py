"""The Triton-language attention kernels, run by the Triton interpreter on CPU tensors, against
the pure-PyTorch reference backend: the cache write, paged decode (GQA, split-K), prefill and
chunked prefill (cached prefixes), per-layer sliding windows and logit soft-caps, head dims 64
to 256, three dtypes, and whole model forwards (Llama, Mistral, Gemma 2 and 3).

Tolerances (absolute, outputs of magnitude ~1): fp32 2e-5 (both sides accumulate in fp32; the
kernels' online softmax only reorders the sums); fp16 5e-3 and bf16 2e-2 (the kernels round the
probabilities to the input dtype before the P.V dot, as flash attention does on tensor cores;
the rest is the output's rounding). Under the interpreter bf16 dots are widened to fp32 (see
triton_kernels.py), so the bf16 P.V rounding is checked on a GPU only (the `gpu` tests).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
from test_cpu_attention import make_step

from pagedllm.layers.attention import create_attention_backend, kv_quant
from pagedllm.layers.attention.base import AttnLayer
from pagedllm.layers.attention.torch_ref import TorchAttentionBackend
from pagedllm.layers.attention.triton_launch import KernelConfig, num_decode_splits, prefill_launch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="the triton package is missing: pip install -e '.[dev]'",
)

ATOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def tk() -> ModuleType:
    """The kernels module, run by the Triton interpreter (conftest.py sets TRITON_INTERPRET=1
    on a machine without CUDA, before anything imports triton)."""
    module = importlib.import_module("pagedllm.layers.attention.triton_kernels")
    assert module.INTERPRETED
    return module


def small_tiles(tk: ModuleType, **overrides: int) -> object:
    """Tiles of 16 so that the small test shapes cross several tiles."""
    knobs = dict(decode_block_n=16, prefill_block_m=16, prefill_block_n=16)
    return KernelConfig(**{**knobs, **overrides})


def to_head_major(ref_cache: torch.Tensor) -> torch.Tensor:
    # (blocks, block_size, 2, kv_heads, hd) -> (blocks, 2, kv_heads, block_size, hd)
    return ref_cache.permute(0, 2, 3, 1, 4).contiguous()


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as bytes (torch compares no fp8 tensors on the CPU); others as they are."""
    return cache.view(torch.uint8) if cache.element_size() == 1 else cache


def run_both(
    tk: ModuleType,
    requests: list[tuple[int, int]],
    *,
    block_size: int = 8,
    head_dim: int = 64,
    group: int = 3,
    kv_heads: int = 1,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    softcap: float | None = None,
    num_decodes: int | None = None,
    config: object | None = None,
    perturb: Callable[[AttnLayer], AttnLayer] | None = None,
    cache_dtype: torch.dtype | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Triton backend output, reference output) for one layer of one step on random inputs;
    also checks that both caches hold the same keys and values afterwards. `perturb` changes
    the Triton side's layer only (for the tests that must detect a mistake); `cache_dtype`: an
    fp8 cache (kv_cache_dtype.py), on both sides, with the layer's `kv_scales`."""
    from pagedllm.layers.attention.triton_backend import TritonAttentionBackend

    step, num_blocks = make_step(requests, block_size, num_decodes)
    gen = torch.Generator().manual_seed(block_size * 1000 + head_dim + group)
    n, heads = len(step.positions), kv_heads * group
    cache = torch.randn(num_blocks, block_size, 2, kv_heads, head_dim, generator=gen).to(dtype)
    if cache_dtype is not None:
        cache = kv_quant.quantize_fp8(cache, cache_dtype)
    # q and kv are strided views of one qkv buffer, as in the model
    qkv = torch.randn(n, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    q, kv = qkv[:, :heads], qkv[:, heads:].view(n, 2, kv_heads, head_dim)
    layer = AttnLayer(head_dim**-0.5, window, softcap, None, *kv_scales)

    ref, ref_cache = TorchAttentionBackend(), cache.clone()
    expected = ref.forward(q, kv, ref_cache, ref.build_metadata(step), layer)
    backend = TritonAttentionBackend(config or small_tiles(tk))  # type: ignore[arg-type]
    tri_cache = to_head_major(cache)
    meta = backend.build_metadata(step)
    out = backend.forward(q, kv, tri_cache, meta, perturb(layer) if perturb else layer)
    assert torch.equal(as_bytes(tri_cache), as_bytes(to_head_major(ref_cache)))
    assert out.shape == (n, heads, head_dim) and out.dtype == dtype
    return out, expected


def assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL[out.dtype], rtol=0)


# --- the cache write -------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_write_kv_stores_each_slot_and_skips_padding(tk: ModuleType, block_size: int) -> None:
    n, kv_heads, head_dim, num_blocks = 11, 3, 64, 16
    gen = torch.Generator().manual_seed(block_size)
    kv = torch.randn(n, 2, kv_heads, head_dim, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[[2, 7]] = -1  # padding rows of a CUDA-graph batch
    cache = torch.zeros(num_blocks, 2, kv_heads, block_size, head_dim)
    tk.write_kv(kv, cache, slots)
    expected = torch.zeros(num_blocks, block_size, 2, kv_heads, head_dim)
    keep = slots >= 0
    expected.view(-1, 2, kv_heads, head_dim)[slots[keep]] = kv[keep]
    assert torch.equal(cache, to_head_major(expected))


# --- decode ----------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_decode_matches_reference(
    tk: ModuleType, block_size: int, head_dim: int, group: int
) -> None:
    # ragged: one token, exactly one block, one past a block boundary, several key tiles
    bs = block_size
    requests = [(0, 1), (bs - 1, 1), (bs, 1), (3 * bs + 4, 1), (36, 1)]
    out, expected = run_both(tk, requests, block_size=bs, head_dim=head_dim, group=group)
    assert_matches(out, expected)


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("num_splits", [2, 4, 8])
def test_decode_split_k_matches_reference(
    tk: ModuleType, num_splits: int, window: int | None, softcap: float | None
) -> None:
    # 8 splits of a 3-tile context: some splits see no key at all
    cfg = small_tiles(tk, max_splits=num_splits, min_split_tokens=1, num_sms=64)
    assert num_decode_splits(3, 2, 70, cfg) == num_splits
    requests = [(2, 1), (40, 1), (69, 1)]
    out, expected = run_both(
        tk, requests, kv_heads=2, group=2, config=cfg, block_size=16, window=window, softcap=softcap
    )
    assert_matches(out, expected)


def test_split_heuristic() -> None:
    cfg = KernelConfig()  # 132 SMs, splits of >= 256 tokens, at most 16
    assert num_decode_splits(256, 8, 8192, cfg) == 1  # the batch fills the GPU
    assert num_decode_splits(1, 8, 8192, cfg) == 32 // 2  # 264 programs wanted, capped at 16
    assert num_decode_splits(1, 8, 300, cfg) == 2  # no split below 256 tokens
    assert num_decode_splits(4, 8, 100, cfg) == 1
    with pytest.raises(ValueError, match="power of two"):
        KernelConfig(decode_block_n=48)
    with pytest.raises(ValueError, match=">= 16"):
        KernelConfig(prefill_block_m=8)


def test_a_windowed_layer_splits_its_window_only() -> None:
    """One step's metadata serves every layer: a windowed layer splits at most its window,
    for the heuristic (eager) and for a count a graph fixed alike."""
    from pagedllm.layers.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend()
    step, _ = make_step([(8000, 1)], 16)
    eager = backend.build_metadata(step)
    graph = backend.decode_metadata(
        step.slot_mapping, step.block_tables.int(), torch.tensor([8001], dtype=torch.int32), 16
    )
    for meta in (eager, graph):
        assert backend.decode_splits(meta, 8, None) == 16
        assert backend.decode_splits(meta, 8, 512) == 2
        assert backend.decode_splits(meta, 8, 100) == 1


# --- prefill and chunked prefill ------------------------------------------------------------

# (cached prefix, new tokens): empty prefix; a prefix of whole blocks (a prefix-cache hit);
# a ragged prefix ending inside a block with a chunk crossing several blocks and query tiles;
# only the last token recomputed after a fully cached prompt
PREFILLS = [(0, 5), (16, 9), (11, 22), (40, 1)]


@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16])
def test_prefill_matches_reference(
    tk: ModuleType, block_size: int, head_dim: int, group: int
) -> None:
    out, expected = run_both(
        tk, PREFILLS, block_size=block_size, head_dim=head_dim, group=group, num_decodes=0
    )
    assert_matches(out, expected)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_prefill_without_cached_prefix(tk: ModuleType, softcap: float | None) -> None:
    requests = [(0, 17), (0, 1), (0, 32)]
    out, expected = run_both(tk, requests, num_decodes=0, kv_heads=2, softcap=softcap)
    assert_matches(out, expected)


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("window", [1, 6, 40])
def test_sliding_window_matches_reference(
    tk: ModuleType, window: int, softcap: float | None
) -> None:
    # decodes and chunks with contexts shorter than, equal to and longer than the window
    requests = [(0, 1), (5, 1), (6, 1), (45, 1), (0, 6), (11, 22), (40, 3)]
    out, expected = run_both(tk, requests, window=window, softcap=softcap, kv_heads=2, group=2)
    assert_matches(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (6, None), (None, 1.5), (6, 50.0)])
def test_mixed_batch_dtypes(
    tk: ModuleType, dtype: torch.dtype, window: int | None, softcap: float | None
) -> None:
    # 3 decodes (one on its first token), then two prefill chunks (one with a cached prefix)
    requests = [(0, 1), (8, 1), (29, 1), (11, 9), (0, 20)]
    out, expected = run_both(
        tk, requests, dtype=dtype, window=window, softcap=softcap, kv_heads=2, group=3
    )
    assert_matches(out, expected)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_cache_matches_reference(
    tk: ModuleType, dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """The write casts (saturated) to the same fp8 bits as the reference; decodes (split-K
    too) and prefill chunks read them back widened."""
    requests = [(0, 1), (8, 1), (29, 1), (80, 1), (11, 9), (0, 20)]
    config = small_tiles(tk, decode_block_n=16)
    out, expected = run_both(
        tk, requests, dtype=dtype, kv_heads=2, group=3, cache_dtype=cache_dtype, config=config
    )
    assert_matches(out, expected)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_scales_match_reference(tk: ModuleType, cache_dtype: torch.dtype) -> None:
    """Per-layer k_scale / v_scale (vLLM's): the write stores k / k_scale (the same bits as
    the reference), decodes (split-K too), chunks and prompts read fp8 * scale; unlike the
    output at scale 1."""
    requests = [(0, 1), (8, 1), (29, 1), (80, 1), (11, 9), (0, 20)]
    config = small_tiles(tk, decode_block_n=16)
    common = dict(dtype=torch.float16, kv_heads=2, group=3, cache_dtype=cache_dtype)
    out, expected = run_both(tk, requests, config=config, kv_scales=(0.37, 2.9), **common)
    assert_matches(out, expected)
    plain, _ = run_both(tk, requests, config=config, **common)
    assert (out.float() - plain.float()).abs().amax() > 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (20, 2.0)])
@pytest.mark.parametrize("split", [False, True])
def test_head_dim_256(
    tk: ModuleType, dtype: torch.dtype, window: int | None, softcap: float | None, split: bool
) -> None:
    """Gemma 2 / 3's head dim, with the tiles the GPU runs (`KernelConfig()`): decodes
    split and unsplit, a chunk over a cached prefix, a prompt; GQA."""
    cfg = KernelConfig(min_split_tokens=16 if split else 1 << 20)
    requests = [(3, 1), (75, 1), (40, 30), (0, 9)]
    out, expected = run_both(
        tk, requests, config=cfg, head_dim=256, dtype=dtype, window=window, softcap=softcap
    )
    assert_matches(out, expected)


@pytest.mark.parametrize(
    "tiles",
    [
        dict(decode_block_n=16, prefill_block_m=16, prefill_block_n=32),
        dict(decode_block_n=64, prefill_block_m=32, prefill_block_n=16),
        dict(decode_block_n=32, prefill_block_m=64, prefill_block_n=64),
    ],
)
def test_tile_sizes_do_not_change_results(tk: ModuleType, tiles: dict[str, int]) -> None:
    requests = [(3, 1), (50, 1), (7, 30), (0, 12)]
    out, expected = run_both(tk, requests, config=KernelConfig(**tiles), head_dim=128)
    assert_matches(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 96])
def test_default_launches_match_reference(
    tk: ModuleType, dtype: torch.dtype, head_dim: int
) -> None:
    """The tiles the GPU runs (`decode_launch` / `prefill_launch`, no override): in fp32 at
    head dim 96 a host tile of 64 rows runs as two programs of 32 (a 70-row chunk fills
    both programs of its first tile and part of its second)."""
    cfg = KernelConfig()
    assert prefill_launch(cfg, dtype, head_dim).block_m == (
        32 if dtype == torch.float32 and head_dim == 96 else 64
    )
    # decodes over 1 and 3 key tiles of the widest (128-key) launch
    requests = [(40, 1), (300, 1), (5, 70), (0, 3)]
    out, expected = run_both(tk, requests, config=cfg, head_dim=head_dim, dtype=dtype)
    assert_matches(out, expected)


def test_kernels_accept_the_reference_layout_as_a_view(tk: ModuleType) -> None:
    # strides, not a fixed layout: a permuted view of the reference cache works in place
    step, num_blocks = make_step([(9, 1), (20, 1)], 4)
    gen = torch.Generator().manual_seed(3)
    ref_cache = torch.randn(num_blocks, 4, 2, 2, 64, generator=gen)
    q = torch.randn(2, 4, 64, generator=gen)
    kv = torch.randn(2, 2, 2, 64, generator=gen)
    ref = TorchAttentionBackend()
    expected = ref.forward(q, kv, ref_cache.clone(), ref.build_metadata(step), AttnLayer(0.125))
    view = ref_cache.permute(0, 2, 3, 1, 4)  # not contiguous
    tk.write_kv(kv, view, step.slot_mapping)
    out = torch.empty_like(q)
    ctx = torch.tensor(step.context_lens, dtype=torch.int32)
    tk.paged_decode(out, q, view, step.block_tables.int(), ctx, 0.125, 1)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)


# --- the comparison can fail ----------------------------------------------------------------


def test_a_wrong_scale_is_detected(tk: ModuleType) -> None:
    wrong = lambda layer: layer._replace(scale=layer.scale * 1.02)  # noqa: E731
    out, expected = run_both(tk, [(8, 1), (11, 9)], perturb=wrong)
    with pytest.raises(AssertionError):
        assert_matches(out, expected)


@pytest.mark.parametrize("requests", [[(30, 1)], [(30, 6)]])
def test_one_masked_key_is_detected(tk: ModuleType, requests: list[tuple[int, int]]) -> None:
    # the Triton side drops a single key of the longest row (a window of ctx - 1 tokens)
    narrow = lambda layer: layer._replace(window=sum(requests[0]) - 1)  # noqa: E731
    out, expected = run_both(tk, requests, perturb=narrow)
    with pytest.raises(AssertionError):
        assert_matches(out, expected)


@pytest.mark.parametrize(("softcap", "wrong"), [(50.0, None), (50.0, 49.0), (None, 50.0)])
def test_a_wrong_softcap_is_detected(
    tk: ModuleType, softcap: float | None, wrong: float | None
) -> None:
    # Gemma 2's cap of 50 barely bends these scores (|s| < 5): dropping or moving it must show
    perturb = lambda layer: layer._replace(softcap=wrong)  # noqa: E731
    out, expected = run_both(tk, [(20, 1), (11, 9)], softcap=softcap, perturb=perturb)
    with pytest.raises(AssertionError):
        assert_matches(out, expected)


def test_registry_picks_triton_on_cuda() -> None:
    from pagedllm.layers.attention.triton_backend import TritonAttentionBackend

    assert isinstance(create_attention_backend("auto", "cuda"), TritonAttentionBackend)
    assert isinstance(create_attention_backend("auto", "cuda:1"), TritonAttentionBackend)
    assert isinstance(create_attention_backend("triton", "cpu"), TritonAttentionBackend)
    assert create_attention_backend("torch", "cuda").name == "torch"

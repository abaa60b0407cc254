"""Latent attention's Triton kernels (layers/attention/triton_mla.py), run by the Triton
interpreter on CPU tensors: the absorbed decode against model/mla.py's `decode_absorbed` (torch)
at DeepSeek-V3's latent (rank 512 + rope 64) and tiny sizes, contexts crossing block
boundaries, split-K, fp32 / fp16 / bf16; the cache write with padded slots; a tiny DeepSeek-V3
model's steps through the GPU backend (layers/attention/mla_backend.py) against the reference
backend, eager and over a CUDA graph's padded decode buffers.

Tolerances as test_triton_kernels.py's (outputs ~1): fp32 2e-5 ... (the rank-512 dots sum 512
products: 5e-5), fp16 5e-3, bf16 2e-2."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from test_mla import make_checkpoint
from test_triton_models import model_step

from pagedllm.layers.attention.triton_launch import KernelConfig
from pagedllm.model.mla import MlaWeights, absorb_query, decode_absorbed, expand_output

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="the triton package is missing: pip install -e '.[dev]'",
)

ATOL = {torch.float32: 5e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# (heads, qk_nope, rope, v_head_dim, kv_lora_rank): DeepSeek-V3's per-head widths and latent
# (16 heads: one rank's share of 128 under TP 8), and the tiny model's of test_mla.py
SIZES = {"deepseek-v3": (16, 128, 64, 128, 512), "tiny": (4, 16, 8, 24, 32)}


@pytest.fixture(scope="module")
def tm() -> ModuleType:
    """The kernels, run by the interpreter (conftest.py sets TRITON_INTERPRET=1 here)."""
    module = importlib.import_module("pagedllm.layers.attention.triton_mla")
    assert importlib.import_module("pagedllm.layers.attention.triton_kernels").INTERPRETED
    return module


def random_weights(heads: int, nope: int, v: int, rank: int, dtype: torch.dtype) -> MlaWeights:
    g = torch.Generator().manual_seed(3)
    kv_b = (torch.randn(heads, nope + v, rank, generator=g) / rank**0.5).to(dtype)
    none: Any = None
    return MlaWeights(none, None, None, none, none, None, none, kv_b[:, :nope], kv_b[:, nope:])


def paged(lens: list[int], block_size: int, num_blocks: int) -> torch.Tensor:
    """Each request's block table: distinct blocks, shuffled, padded with 0."""
    width = max(-(-n // block_size) for n in lens)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    tables = []
    for n in lens:
        need = -(-n // block_size)
        tables.append(order[:need] + [0] * (width - need))
        order = order[need:]
    return torch.tensor(tables, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_matches_decode_absorbed(
    tm: ModuleType, sizes: str, dtype: torch.dtype, splits: int
) -> None:
    """Contexts of 1, 16 (one whole block), 17 and 70 rows (across blocks), 0 (a graph's
    padding row: output 0)."""
    heads, nope, rope, v, rank = SIZES[sizes]
    block_size, lens = 16, [17, 1, 70, 16, 0]
    d, dim = len(lens), rank + rope
    g = torch.Generator().manual_seed(0)
    w = random_weights(heads, nope, v, rank, dtype)
    q_nope = torch.randn(d, heads, nope, generator=g).to(dtype)
    q_rope = torch.randn(d, heads, rope, generator=g).to(dtype)
    cache = torch.randn(24, block_size, dim, generator=g).to(dtype)
    tables = paged(lens, block_size, 24)
    scale = (nope + rope) ** -0.5
    query = torch.cat([absorb_query(q_nope, w), q_rope], dim=-1)
    cfg = KernelConfig(decode_block_n=16)
    context = torch.tensor(lens, dtype=torch.int32)
    got = expand_output(tm.mla_decode(query, cache, tables, context, rank, scale, splits, cfg), w)

    t = tables.shape[1] * block_size
    ctx = cache[tables.long()].view(d, t, dim)
    mask = (torch.arange(t) < context[:, None])[:, None, None, :]
    live = context > 0  # SDPA's row without keys is NaN: the kernel's is 0
    want = decode_absorbed(q_nope[live], q_rope[live], ctx[live], mask[live], w, scale)
    torch.testing.assert_close(got[live], want, atol=ATOL[dtype], rtol=0)
    assert not got[~live].any()


def test_split_changes_nothing_but_rounding(tm: ModuleType) -> None:
    """Splits that see no row (the short contexts) weigh 0 in the reduction."""
    heads, rank, rope, lens = 4, 32, 8, [3, 300]
    g = torch.Generator().manual_seed(2)
    query = torch.randn(2, heads, rank + rope, generator=g)
    cache = torch.randn(40, 16, rank + rope, generator=g)
    tables, context = paged(lens, 16, 40), torch.tensor(lens, dtype=torch.int32)
    cfg = KernelConfig(decode_block_n=16)
    one = tm.mla_decode(query, cache, tables, context, rank, 0.2, 1, cfg)
    for splits in (2, 8, 16):
        split = tm.mla_decode(query, cache, tables, context, rank, 0.2, splits, cfg)
        torch.testing.assert_close(split, one, atol=2e-6, rtol=0)


def test_write_latent_skips_padding(tm: ModuleType) -> None:
    cache = torch.zeros(4, 8, 40)
    new = torch.randn(5, 40)
    slots = torch.tensor([9, -1, 0, 31, -1])
    tm.write_latent(new, cache, slots)
    want = torch.zeros(32, 40)
    want[[9, 0, 31]] = new[[0, 2, 3]]
    torch.testing.assert_close(cache.view(32, 40), want, atol=0, rtol=0)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("mla-triton"))


def test_model_steps_match_reference(tm: ModuleType, deepseek: Path) -> None:
    """A tiny DeepSeek-V3 (MLA, q_lora): three prompts (one chunked), then two decodes and the
    second chunk; then a decode step over a graph's padded buffers (decode_metadata: 4 rows, 2
    of them padding with slot -1 and context 0). The GPU backend's logits and latent caches
    equal the reference backend's (the caches: the second layer's to rounding)."""
    from pagedllm.config import ModelConfig
    from pagedllm.layers.attention.mla_backend import MlaTritonBackend
    from pagedllm.layers.attention.torch_ref import TorchAttentionBackend
    from pagedllm.model import load_model
    from pagedllm.model.decoder import ForwardContext
    from pagedllm.model.rope import rotary_table

    mcfg = ModelConfig.from_model_dir(deepseek)
    assert mcfg.mla is not None
    model = load_model(deepseek, mcfg, torch.float32, "cpu")
    rotary = rotary_table(mcfg.ropes[0], mcfg.head_dim, 512, 512)
    block_size, num_blocks = 8, 24
    tables = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))[:18]
    tables = tables.view(3, 6)
    tokens = torch.randint(2, mcfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))

    plan = [
        ([(0, 0, 12), (1, 0, 20), (2, 0, 7)], 0),
        ([(0, 12, 1), (2, 7, 1), (1, 20, 14)], 2),
        ([(1, 34, 1), (0, 13, 1)], 2),
    ]
    steps = [model_step(tokens, tables, block_size, r, d) for r, d in plan]
    results = []
    for backend in (TorchAttentionBackend(), MlaTritonBackend()):
        if isinstance(backend, MlaTritonBackend):
            backend.config = KernelConfig(decode_block_n=16)
        caches = [torch.zeros(num_blocks, block_size, mcfg.mla.cache_dim) for _ in range(2)]
        logits = []
        for i, s in enumerate(steps):
            meta = backend.build_metadata(s)
            ids, positions, wanted = s.input_ids, s.positions, s.logits_indices
            if i == 2 and isinstance(backend, MlaTritonBackend):  # a graph's buffers: 4 rows
                pad = torch.tensor([0, 0])
                ids, positions = torch.cat([ids, pad]), torch.cat([positions, pad])
                bt = torch.cat([s.block_tables, s.block_tables]).int()
                ctx = torch.tensor([*s.context_lens, 0, 0], dtype=torch.int32)
                slots = torch.cat([s.slot_mapping, torch.tensor([-1, -1])])
                meta = backend.decode_metadata(slots, bt, ctx, 2)
                wanted = torch.arange(4)
            fc = ForwardContext((rotary[positions].unsqueeze(1),), caches, backend, meta)
            with torch.inference_mode():
                logits.append(model(ids, fc, wanted)[: len(s.context_lens)])
        results.append((logits, caches))
    (ref_logits, ref_caches), (tri_logits, tri_caches) = results
    for expected, got in zip(ref_logits, tri_logits, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # the first layer's rows bit for bit (the same inputs); the second's after its attention
    torch.testing.assert_close(tri_caches[0], ref_caches[0], atol=0, rtol=0)
    torch.testing.assert_close(tri_caches[1], ref_caches[1], atol=1e-5, rtol=0)
    assert ref_caches[1].abs().sum() > 0

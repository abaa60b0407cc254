"""Attention sinks (gpt-oss: a learned logit per query head in each query's softmax
denominator, without a value) in every attention backend — the torch reference, the CPU
backend (its C++ decode kernel, both of its thread paths, and the reference prefill) and the
Triton kernels under the interpreter (decode, split-K, prefill, chunked prefill) — against
transformers' own gpt-oss `eager_attention_forward`, request by request over a dense copy of
each context: decodes, a prompt, a chunk over a cached prefix; a sliding window; MHA and
GQA; fp32 and bf16.

Tolerances as the backends' own tests (test_cpu_attention, test_triton_kernels): fp32 2e-5,
bf16 2e-2 (the probabilities rounded to bf16 before P.V, and the output's rounding).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_cpu_attention import make_step, num_threads
from torch.utils.cpp_extension import is_ninja_available
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from pagedllm.layers.attention import AttentionBackend, StepInputs, cpu_kernels
from pagedllm.layers.attention.base import AttnLayer
from pagedllm.layers.attention.cpu_backend import CpuAttentionBackend
from pagedllm.layers.attention.torch_ref import TorchAttentionBackend
from pagedllm.layers.attention.triton_launch import KernelConfig

ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BLOCK_SIZE = 8

# decodes (one on its first token, one past the window), then a prompt and a chunk over a
# cached prefix that ends inside a block
MIXED = [(0, 1), (8, 1), (29, 1), (0, 13), (11, 9)]

needs_cxx = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None or not is_ninja_available(),
    reason="no C++ compiler or ninja",
)
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="the triton package is missing"
)


def oracle(
    q: torch.Tensor, cache: torch.Tensor, step: StepInputs, layer: AttnLayer
) -> torch.Tensor:
    """transformers' gpt-oss eager attention of each request's queries over its context,
    gathered slot by slot from `cache` (the new keys/values written), in fp32; causal, with
    the layer's window, as an additive mask."""
    kv_heads, heads = cache.shape[3], q.shape[1]
    # what it reads of its nn.Module
    module: Any = SimpleNamespace(
        num_key_value_groups=heads // kv_heads, sinks=layer.sinks, training=False
    )
    slots_kv = cache.flatten(0, 1).float()  # (slots, 2, kv_heads, head_dim)
    out = torch.empty(q.shape)
    for r, ctx in enumerate(step.context_lens):
        start, end = step.query_start_loc[r], step.query_start_loc[r + 1]
        pos = torch.arange(ctx)
        kv = slots_kv[step.block_tables[r, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE]
        k, v = kv[:, 0].transpose(0, 1)[None], kv[:, 1].transpose(0, 1)[None]  # (1, kv, T, hd)
        q_pos = torch.arange(ctx - (end - start), ctx)[:, None]
        visible = pos[None, :] <= q_pos
        if layer.window is not None:
            visible &= pos[None, :] > q_pos - layer.window
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
        query = q[start:end].float().transpose(0, 1)[None]  # (1, heads, L, hd)
        o, _ = eager_attention_forward(module, query, k, v, mask, scaling=layer.scale)
        out[start:end] = o[0]
    return out


def case(
    requests: list[tuple[int, int]],
    dtype: torch.dtype,
    window: int | None,
    group: int,
    kv_heads: int = 2,
    sink_mean: float = 3.0,
) -> tuple[StepInputs, torch.Tensor, torch.Tensor, torch.Tensor, AttnLayer]:
    """(step, q, new kv, reference-layout cache, layer with random sinks) on random values;
    q and kv are views of one qkv projection, as in the model. The scores are ~N(0, 1): a
    sink of `sink_mean` takes about half the mass of a context of exp(sink_mean) keys."""
    step, num_blocks = make_step(requests, BLOCK_SIZE)
    gen = torch.Generator().manual_seed(7 * group + (window or 0))
    n, heads, head_dim = len(step.positions), kv_heads * group, 64
    cache = torch.randn(num_blocks, BLOCK_SIZE, 2, kv_heads, head_dim, generator=gen).to(dtype)
    qkv = torch.randn(n, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    q, kv = qkv[:, :heads], qkv[:, heads:].view(n, 2, kv_heads, head_dim)
    # from barely felt to taking most of the mass
    sinks = torch.randn(heads, generator=gen) * 2 + sink_mean
    return step, q, kv, cache, AttnLayer(head_dim**-0.5, window, None, sinks)


def check(out: torch.Tensor, expected: torch.Tensor, without: torch.Tensor) -> None:
    """`out` matches the oracle, and the sinks matter at this tolerance (`without`: the
    backend's output without them)."""
    atol = ATOL[out.dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=0)
    assert (without.float() - expected).abs().max() > 5 * atol, "the sinks change nothing"


def run_backend(
    backend: AttentionBackend,
    step: StepInputs,
    q: torch.Tensor,
    kv: torch.Tensor,
    cache: torch.Tensor,
    layer: AttnLayer,
    head_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output with the sinks, output without, the cache written, in the reference layout)."""
    outs = []
    for lay in (layer, layer._replace(sinks=None)):
        c = cache.permute(0, 2, 3, 1, 4).contiguous() if head_major else cache.clone()
        outs.append(backend.forward(q, kv, c, backend.build_metadata(step), lay))
    written = c.permute(0, 3, 1, 2, 4) if head_major else c
    return outs[0], outs[1], written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("group", [1, 4])
def test_torch_reference(group: int, window: int | None, dtype: torch.dtype) -> None:
    step, q, kv, cache, layer = case(MIXED, dtype, window, group)
    out, without, written = run_backend(TorchAttentionBackend(), step, q, kv, cache, layer)
    check(out, oracle(q, written, step, layer), without)


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("group", [1, 4])
def test_cpu_backend(group: int, window: int | None, dtype: torch.dtype) -> None:
    # the decodes through the C++ kernel, one (request, KV head) pass each; the chunks through
    # the reference
    backend = CpuAttentionBackend()
    assert backend.kernel_available
    step, q, kv, cache, layer = case(MIXED, dtype, window, group)
    with num_threads(1):
        out, without, written = run_backend(backend, step, q, kv, cache, layer)
    check(out, oracle(q, written, step, layer), without)


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 100])
def test_cpu_kernel_keys_cut_over_threads(window: int | None, dtype: torch.dtype) -> None:
    # one request of one KV head on 2 threads: its keys cut into two runs, their sums merged
    # (the sink joins the merge once); and a first token (one key) beside a long context
    backend = CpuAttentionBackend()
    for requests in ([(299, 1)], [(0, 1), (150, 1)]):
        step, q, kv, cache, layer = case(requests, dtype, window, 3, kv_heads=1, sink_mean=5)
        with num_threads(2):
            out, without, written = run_backend(backend, step, q, kv, cache, layer)
        check(out, oracle(q, written, step, layer), without)


@needs_cxx
def test_cpu_kernel_rejects_bad_sinks() -> None:
    step, q, _, cache, layer = case([(5, 1)], torch.float32, None, group=2)
    out, ctx = torch.empty(q.shape), torch.tensor(step.context_lens)
    assert layer.sinks is not None
    for bad in (layer.sinks.double(), layer.sinks[:-1], torch.zeros(8)[::2]):
        with pytest.raises(RuntimeError, match="sinks"):
            cpu_kernels.paged_decode_attention(
                out, q, cache, step.block_tables, ctx, layer.scale, sinks=bad
            )


@needs_triton
@pytest.mark.parametrize(
    ("splits", "group", "window", "dtype"),
    [
        (1, 4, None, "fp32"),
        (1, 1, 6, "bf16"),
        (4, 1, None, "fp32"),
        (4, 4, 6, "fp32"),
        (4, 4, None, "bf16"),
    ],
)
def test_triton_backend(splits: int, group: int, window: int | None, dtype: str) -> None:
    # tiles of 16 (several per context); 4 splits: the decodes' sinks join in the reduction,
    # and some splits see no key at all
    from pagedllm.layers.attention.triton_backend import TritonAttentionBackend

    cfg = KernelConfig(
        decode_block_n=16,
        prefill_block_m=16,
        prefill_block_n=16,
        max_splits=splits,
        min_split_tokens=1,
        num_sms=1,
    )
    step, q, kv, cache, layer = case(MIXED, DTYPES[dtype], window, group)
    backend = TritonAttentionBackend(cfg)
    out, without, written = run_backend(backend, step, q, kv, cache, layer, head_major=True)
    check(out, oracle(q, written, step, layer), without)

"""The GPU path of `lora/ops.py` in the Triton language (punica's BGMV): a step's LoRA deltas
for every token in two launches, whatever the adapters present. `_lora_shrink`: one program
per token, t[n] = A[s] x[n] (fp32, the rank dimension in one tile, x read in chunks of
BLOCK_K); `_lora_expand`: one program per (token, block of BLOCK_M outputs), out[n] += B[s]
t[n], rounded once to the dtype. Base-model tokens (slot -1) read and write nothing. Tiles
are capped at 4096 elements (no register spills at rank 3 x 64). Tested under the Triton
interpreter on the CPU, compiled for real GPUs in the tests (layers/kernel_workloads.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096  # elements of a program's A or B tile


@triton.jit
def _lora_shrink(
    x_ptr, a_ptr, slots_ptr, t_ptr, K, R, x_stride, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr
):
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + n)  # -1: a base-model token, nothing read or written
    used, s = slot >= 0, tl.maximum(slot, 0).to(tl.int64)
    rs = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + n * x_stride + ks, mask=(ks < K) & used, other=0.0).to(tl.float32)
        tile = (rs[:, None] < R) & (ks[None, :] < K) & used
        a = tl.load(a_ptr + s * R * K + rs[:, None] * K + ks[None, :], mask=tile, other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(t_ptr + n * R + rs, acc, mask=(rs < R) & used)


@triton.jit
def _lora_expand(
    t_ptr, b_ptr, slots_ptr, out_ptr, M, R, out_stride, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr
):
    n, ms = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slots_ptr + n)
    used, s, rs = slot >= 0, tl.maximum(slot, 0).to(tl.int64), tl.arange(0, BLOCK_R)
    t = tl.load(t_ptr + n * R + rs, mask=(rs < R) & used, other=0.0)
    tile = (ms[:, None] < M) & (rs[None, :] < R) & used
    b = tl.load(b_ptr + s * M * R + ms[:, None] * R + rs[None, :], mask=tile, other=0.0)
    delta = tl.sum(b.to(tl.float32) * t[None, :], axis=1)
    keep = (ms < M) & used
    old = tl.load(out_ptr + n * out_stride + ms, mask=keep, other=0.0)
    new = old.to(tl.float32) + delta
    tl.store(out_ptr + n * out_stride + ms, new.to(out_ptr.dtype.element_ty), mask=keep)


def lora_bgmv_triton(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
) -> None:
    """out (N, M) += B[s_n] A[s_n] x[n] for every token n with slot s_n >= 0, in place.
    x (N, K) and out with unit stride in their last dim; a (slots, R, K), b (slots, M, R)
    contiguous; token_slots (N,) int64."""
    n, k = x.shape
    r, m = a.shape[1], b.shape[1]
    if n == 0:
        return
    t = torch.empty(n, r, dtype=torch.float32, device=x.device)
    block_r = triton.next_power_of_2(r)
    block_k = max(16, min(triton.next_power_of_2(k), TILE // block_r))
    block_m = max(16, min(triton.next_power_of_2(m), TILE // block_r))
    _lora_shrink[(n,)](x, a, token_slots, t, k, r, x.stride(0), BLOCK_R=block_r, BLOCK_K=block_k)
    grid = (n, triton.cdiv(m, block_m))
    _lora_expand[grid](
        t, b, token_slots, out, m, r, out.stride(0), BLOCK_R=block_r, BLOCK_M=block_m
    )

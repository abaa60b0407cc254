"""Fused mixture-of-experts in the Triton language: the GPU path of `layers.moe` (dense
fp16 / bf16 / fp32 experts; quantized ones are not supported here: the caller falls back).

The (token, k) pairs, `p = n * k + j`, are sorted by expert and each expert's group is padded
to a multiple of the M tile (`align_pairs`, torch ops, no host sync), so that every M-block
of the sorted list belongs to one expert. Two grouped GEMMs run over those M-blocks:

- `_moe_gate_up_kernel`, grid (M-blocks, cdiv(I, BLOCK_N)): x[p // k] @ w13[e]^T, the gate
  and the up tile of the same columns side by side (+ b13), then the gated activation:
  h[p] = act(gate) * up, (N*k, I) in x's dtype;
- `_moe_down_kernel`, grid (M-blocks, cdiv(H, BLOCK_N)): (h[p] @ w2[e]^T + b2) * weight[p],
  (N*k, H) in fp32;

then each token's k rows are summed (fp32, as `experts_loop`) and rounded to x's dtype.
Both accumulate in fp32. The grids are bounded by host-known sizes (`max_blocks`); M-blocks
past the padded total (a device value) return at once. Padding rows hold the sentinel
`N * k` and are masked.

NOTE: under the interpreter (`TRITON_INTERPRET=1`) bf16 tiles are raw 16-bit integers and
`tl.dot` on them is wrong, so bf16 operands are widened to fp32 there (`UPCAST`, as in the
attention kernels); fp16 and fp32 run the GPU code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.layers.moe import ACTIVATIONS, OAI_ALPHA, Experts
from pagedllm.layers.quant import QuantizedWeight

INTERPRETED = bool(triton.knobs.runtime.interpret)
# the kernels read globals only as constexprs (NOTE: tensor * constexpr, not constexpr *
# tensor: the interpreter makes the latter a constexpr)
SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(0.7978845608028654)
SQRT_HALF: tl.constexpr = tl.constexpr(0.7071067811865476)
ALPHA: tl.constexpr = tl.constexpr(OAI_ALPHA)


@dataclass(frozen=True)
class MoeLaunch:
    """One launch's tiles (M: sorted pairs, N: output columns, K: reduction) and options."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def moe_launch(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeLaunch:
    """By the pairs an expert gets on average: decode (<= 16) runs 16-row tiles, so an
    expert's few tokens waste little of its weights' read; prefill 32 or 64. 16-bit stages of
    x (BLOCK_M x 64) and the gate and up tiles (2 x 64 x 64) take 18-24 KiB: 3 stages fit
    sm_89's 99 KiB. fp32 (parity runs) halves the K tile and runs 8 warps (at 4 its 16-row
    gate/up tile spills 4 B on sm_90, its 64-row one takes ~250 registers)."""
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    if dtype == torch.float32:
        return MoeLaunch(block_m, 64, 32, num_warps=8, num_stages=2)
    return MoeLaunch(block_m, 64, 64, num_warps=4, num_stages=3)


def align_pairs(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids (max_blocks * block_m,) int32: the pairs by expert, each expert's group
    padded to a multiple of `block_m` with the sentinel N*k; expert_ids (max_blocks,) int32,
    each M-block's expert (past the padded total: `num_experts`); num_padded (1,) int32, the
    padded total), on topk_ids' device without a host sync. max_blocks bounds the M-blocks
    from host-known sizes: every non-empty expert adds at most one partial block."""
    flat = topk_ids.reshape(-1).long()
    pairs, device = flat.numel(), flat.device
    max_blocks = min(pairs, triton.cdiv(pairs, block_m) + num_experts)
    # NOTE: scatter_add_, not bincount: bincount reads the max on the host
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # (E,) each expert's padded end in the sorted list
    order = torch.argsort(flat, stable=True)  # pairs by expert
    experts = flat[order]
    rank = torch.arange(pairs, device=device) - (counts.cumsum(0) - counts)[experts]
    sorted_ids = torch.full((max_blocks * block_m,), pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, ends[experts] - padded[experts] + rank, order.to(torch.int32))
    starts = torch.arange(max_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(ends, starts, right=True).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gate_up_kernel(
    x_ptr,  # (N, H)
    w_ptr,  # (E, 2I, H): gate rows, then up rows
    b_ptr,  # (E, 2I) when HAS_BIAS
    out_ptr,  # (N*k, I)
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,  # N*k: the padding sentinel
    top_k,
    inter,  # I
    hidden,  # H
    stride_xm,
    stride_we,
    stride_wn,
    stride_be,
    stride_om,
    limit,  # swiglu_oai's clamp
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # hidden % BLOCK_K == 0: no K mask
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # (BLOCK_M,)
    row_mask = pair < num_pairs
    rows = (pair // top_k).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wcols = (cols % inter).to(tl.int64)  # in bounds without a mask; stored masked
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]  # (BLOCK_M, BLOCK_K)
    g_ptrs = w_ptr + expert * stride_we + wcols[None, :] * stride_wn + ks[:, None]  # (K, N)
    u_ptrs = g_ptrs + inter * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            wg = tl.load(g_ptrs)
            wu = tl.load(u_ptrs)
        else:
            k_mask = ks < hidden - k0
            x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=k_mask[:, None], other=0.0)
            wu = tl.load(u_ptrs, mask=k_mask[:, None], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        acc_g = tl.dot(x, wg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(x, wu, acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if HAS_BIAS:
        b_ptrs = b_ptr + expert * stride_be + wcols
        acc_g += tl.load(b_ptrs).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptrs + inter).to(tl.float32)[None, :]
    # NOTE: inline, not a @triton.jit helper: the compile check wants every kernel launched
    if ACTIVATION == "silu":
        act = acc_g * tl.sigmoid(acc_g)
    elif ACTIVATION == "gelu_tanh":  # 0.5 * (1 + tanh(y)) = sigmoid(2 y)
        y = (acc_g + 0.044715 * acc_g * acc_g * acc_g) * (2.0 * SQRT_2_OVER_PI)
        act = acc_g * tl.sigmoid(y)
    elif ACTIVATION == "gelu":
        act = 0.5 * acc_g * (1.0 + tl.erf(acc_g * SQRT_HALF))
    else:  # swiglu_oai
        acc_g = tl.minimum(acc_g, limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit) + 1.0
        act = acc_g * tl.sigmoid(acc_g * ALPHA)
    h = act * acc_u
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + cols[None, :]
    mask = row_mask[:, None] & (cols < inter)[None, :]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(
    h_ptr,  # (N*k, I)
    w_ptr,  # (E, H, I)
    b_ptr,  # (E, H) when HAS_BIAS
    weights_ptr,  # (N*k,) fp32 routing weights
    out_ptr,  # (N*k, H) fp32
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    hidden,  # H: the output columns
    inter,  # I: the reduction
    stride_hm,
    stride_we,
    stride_wn,
    stride_be,
    stride_om,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # inter % BLOCK_K == 0
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs
    rows = pair.to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wcols = (cols % hidden).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None] * stride_hm + ks[None, :]
    w_ptrs = w_ptr + expert * stride_we + wcols[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:
            h = tl.load(h_ptrs, mask=row_mask[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_mask = ks < inter - k0
            h = tl.load(h_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        if UPCAST:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + wcols).to(tl.float32)[None, :]
    weight = tl.load(weights_ptr + rows, mask=row_mask, other=0.0)
    acc = acc * weight[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc, mask=row_mask[:, None] & (cols < hidden)[None, :])


def supported(experts: Experts) -> bool:
    """Dense experts of a float dtype (quantized ones: the caller falls back)."""
    w13, w2 = experts.w13, experts.w2
    if isinstance(w13, QuantizedWeight) or isinstance(w2, QuantizedWeight):
        return False
    return w13.dtype in (torch.float16, torch.bfloat16, torch.float32) and w2.dtype == w13.dtype


def fused_experts_triton(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: Experts,
    launch: MoeLaunch | None = None,
) -> torch.Tensor | None:
    """`experts_loop` in two grouped-GEMM launches: (N, H) -> (N, H) in x's dtype; None when
    the experts are not `supported`. `launch` overrides `moe_launch` (tests: small tiles)."""
    if not supported(experts):
        return None
    w13, w2 = experts.w13, experts.w2
    assert isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
    assert experts.activation in ACTIVATIONS, experts.activation
    n, hidden = x.shape
    num_experts, inter2, _ = w13.shape
    inter, top_k = inter2 // 2, topk_ids.shape[1]
    dtype, x = x.dtype, x.to(w13.dtype).contiguous()
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1
    pairs = n * top_k
    if pairs == 0:
        return torch.zeros_like(x, dtype=dtype)
    cfg = launch or moe_launch(pairs, num_experts, x.dtype)
    sorted_ids, expert_ids, num_padded = align_pairs(topk_ids, num_experts, cfg.block_m)
    m_blocks = expert_ids.numel()
    upcast = INTERPRETED and x.dtype == torch.bfloat16
    precision = "ieee" if x.dtype == torch.float32 else None
    common = dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        UPCAST=upcast,
        PRECISION=precision,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    b13, b2 = experts.b13, experts.b2
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(m_blocks, triton.cdiv(inter, cfg.block_n))](
        x,
        w13,
        w13 if b13 is None else b13,
        h,
        sorted_ids,
        expert_ids,
        num_padded,
        pairs,
        top_k,
        inter,
        hidden,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        0 if b13 is None else b13.stride(0),
        h.stride(0),
        float(experts.limit),
        ACTIVATION=experts.activation,
        HAS_BIAS=b13 is not None,
        EVEN_K=hidden % cfg.block_k == 0,
        **common,
    )
    out = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _moe_down_kernel[(m_blocks, triton.cdiv(hidden, cfg.block_n))](
        h,
        w2,
        w2 if b2 is None else b2,
        weights,
        out,
        sorted_ids,
        expert_ids,
        num_padded,
        pairs,
        hidden,
        inter,
        h.stride(0),
        w2.stride(0),
        w2.stride(1),
        0 if b2 is None else b2.stride(0),
        out.stride(0),
        HAS_BIAS=b2 is not None,
        EVEN_K=inter % cfg.block_k == 0,
        **common,
    )
    return out.view(n, top_k, hidden).sum(1).to(dtype)

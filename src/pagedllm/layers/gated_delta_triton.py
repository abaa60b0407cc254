"""Gated-DeltaNet in the Triton language: the GPU path of `layers.gated_delta`.

- `_conv1d_kernel`, grid (R, cdiv(max_len, BLOCK_T), cdiv(C, BLOCK_C)): each output token
  sums its K taps, a tap before the request's first token read from the slot's conv state
  (zeros for a new request); fp32, then SiLU, rounded to x's dtype.
- `_conv_state_kernel`, grid (R, cdiv(C, BLOCK_C)), launched after it (the conv reads the
  old state, so the new one is written by a second launch): each slot gets its request's last
  K-1 inputs, older state entries shifted in when the request is shorter than K-1.
- `_recurrent_kernel`, grid (R, Hv, cdiv(Dv, BLOCK_V)): the fused recurrent delta rule. A
  program keeps its (Dk, BLOCK_V) fp32 slice of the state in registers and walks its
  request's tokens (a decode: one), q and k l2-normalized in-kernel; it stores the state back
  once at the end. Columns of the state are independent (the delta rule mixes rows only), so
  the value blocks split the work without communication.

NOTE: a prefill runs the recurrent kernel too, one token after the other: exact, but
sequential over the prompt (a chunked Triton form is a later step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.layers.gdn_meta import GdnMeta

CONV_BLOCK_T = 16  # tokens per conv tile; a decode step's tiles have one
CONV_BLOCK_C = 64  # channels (128 took 130-140 registers: 12 warps per SM on sm_80)
RECURRENT_BLOCK_V = 32


@triton.jit
def _conv1d_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, state_ptr, qsl_ptr, idx_ptr, init_ptr,
    stride_x, stride_out, stride_slot, C,
    KW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    bos = tl.load(qsl_ptr + r)
    n = tl.load(qsl_ptr + r + 1) - bos
    if t0 >= n:
        return
    slot = tl.load(idx_ptr + r).to(tl.int64)
    init = tl.load(init_ptr + r) != 0
    offs_t = t0 + tl.arange(0, BLOCK_T)  # token positions within the request
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    mt = offs_t < n
    mc = offs_c < C
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)[None, :]
    rows = bos.to(tl.int64) + offs_t
    for j in tl.static_range(KW):
        back = KW - 1 - j  # this tap reads the input `back` tokens earlier
        w = tl.load(w_ptr + offs_c * KW + j, mask=mc, other=0.0).to(tl.float32)
        in_x = (offs_t >= back) & mt
        xv = tl.load(
            x_ptr + (rows - back)[:, None] * stride_x + offs_c[None, :],
            mask=in_x[:, None] & mc[None, :],
            other=0.0,
        ).to(tl.float32)
        # state entry K-1 + (position - back), oldest first
        in_s = (offs_t < back) & mt & init
        sv = tl.load(
            state_ptr + slot * stride_slot + offs_c[None, :] * (KW - 1)
            + (KW - 1 - back + offs_t)[:, None],
            mask=in_s[:, None] & mc[None, :],
            other=0.0,
        ).to(tl.float32)  # fmt: skip
        acc += (xv + sv) * w[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    out = out_ptr + rows[:, None] * stride_out + offs_c[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mt[:, None] & mc[None, :])


@triton.jit
def _conv_state_kernel(
    x_ptr, state_ptr, qsl_ptr, idx_ptr, init_ptr, stride_x, stride_slot, C,
    KW: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    bos = tl.load(qsl_ptr + r)
    n = tl.load(qsl_ptr + r + 1) - bos
    slot = tl.load(idx_ptr + r).to(tl.int64)
    init = tl.load(init_ptr + r) != 0
    offs_i = tl.arange(0, BLOCK_S)  # the new state's entries, oldest first
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mi = offs_i < KW - 1
    mc = offs_c < C
    pos = n - (KW - 1) + offs_i  # the token each entry holds; < 0: an older state entry
    in_x = (pos >= 0) & mi
    xv = tl.load(
        x_ptr + (bos.to(tl.int64) + pos)[:, None] * stride_x + offs_c[None, :],
        mask=in_x[:, None] & mc[None, :],
        other=0.0,
    )
    base = state_ptr + slot * stride_slot + offs_c[None, :] * (KW - 1)
    in_s = (pos < 0) & mi & init
    sv = tl.load(base + (offs_i + n)[:, None], mask=in_s[:, None] & mc[None, :], other=0.0)
    new = tl.where(in_x[:, None], xv.to(state_ptr.dtype.element_ty), sv)
    tl.debug_barrier()  # every old entry is read before any is overwritten
    tl.store(base + offs_i[:, None], new, mask=mi[:, None] & mc[None, :])


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, qsl_ptr, idx_ptr, init_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt,
    stride_ot, stride_oh, stride_slot, scale,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, L2NORM: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // GROUP
    bos = tl.load(qsl_ptr + r)
    eos = tl.load(qsl_ptr + r + 1)
    slot = tl.load(idx_ptr + r).to(tl.int64)
    init = tl.load(init_ptr + r) != 0
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = offs_k < DK
    mv = offs_v < DV
    mkv = mk[:, None] & mv[None, :]
    s_ptrs = state_ptr + slot * stride_slot + hv * (DK * DV)
    s_ptrs += offs_k[:, None] * DV + offs_v[None, :]
    h = tl.load(s_ptrs, mask=mkv & init, other=0.0)  # (BLOCK_K, BLOCK_V) fp32
    for i in range(0, eos - bos):
        t64 = bos.to(tl.int64) + i
        q = tl.load(q_ptr + t64 * stride_qt + hk * stride_qh + offs_k, mask=mk, other=0.0)
        k = tl.load(k_ptr + t64 * stride_kt + hk * stride_kh + offs_k, mask=mk, other=0.0)
        v = tl.load(v_ptr + t64 * stride_vt + hv * stride_vh + offs_v, mask=mv, other=0.0)
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q * scale
        g = tl.load(g_ptr + t64 * stride_gt + hv)
        beta = tl.load(beta_ptr + t64 * stride_gt + hv)
        h = h * tl.exp(g)
        delta = (v.to(tl.float32) - tl.sum(h * k[:, None], axis=0)) * beta  # (BLOCK_V,)
        h += k[:, None] * delta[None, :]
        o = tl.sum(h * q[:, None], axis=0)
        o_ptrs = o_ptr + t64 * stride_ot + hv * stride_oh + offs_v
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=mv)
    tl.store(s_ptrs, h, mask=mkv)


def causal_conv1d_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    meta: GdnMeta,
    activation: str | None,
) -> torch.Tensor:
    """`gated_delta.causal_conv1d` on the GPU (same arguments)."""
    c = x.shape[1]
    kw = weight.shape[1]
    assert x.stride(1) == 1 and weight.is_contiguous() and conv_state.is_contiguous()
    assert conv_state.shape[1:] == (c, kw - 1)
    out = torch.empty_like(x)
    r = meta.state_indices.shape[0]
    blocks_c = triton.cdiv(c, CONV_BLOCK_C)
    block_t = min(CONV_BLOCK_T, triton.next_power_of_2(meta.max_len))
    grid = (r, triton.cdiv(meta.max_len, block_t), blocks_c)
    _conv1d_kernel[grid](
        x, weight, bias if bias is not None else weight, out, conv_state,
        meta.query_start_loc, meta.state_indices, meta.has_initial_state,
        x.stride(0), out.stride(0), conv_state.stride(0), c,
        KW=kw, HAS_BIAS=bias is not None, SILU=activation == "silu",
        BLOCK_T=block_t, BLOCK_C=CONV_BLOCK_C, num_warps=4,
    )  # fmt: skip
    _conv_state_kernel[(r, blocks_c)](
        x, conv_state, meta.query_start_loc, meta.state_indices, meta.has_initial_state,
        x.stride(0), conv_state.stride(0), c,
        KW=kw, BLOCK_S=triton.next_power_of_2(kw - 1), BLOCK_C=CONV_BLOCK_C, num_warps=4,
    )  # fmt: skip
    return out


def gated_delta_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    meta: GdnMeta,
    l2norm: bool,
) -> torch.Tensor:
    """`gated_delta.gated_delta_rule` on the GPU (same arguments)."""
    n, hk, dk = q.shape
    hv, dv = v.shape[1:]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1
    assert g.is_contiguous() and beta.is_contiguous() and g.dtype == beta.dtype == torch.float32
    assert ssm_state.is_contiguous() and ssm_state.shape[1:] == (hv, dk, dv)
    out = torch.empty(n, hv, dv, dtype=v.dtype, device=v.device)
    r = meta.state_indices.shape[0]
    grid = (r, hv, triton.cdiv(dv, RECURRENT_BLOCK_V))
    _recurrent_kernel[grid](
        q, k, v, g, beta, out, ssm_state,
        meta.query_start_loc, meta.state_indices, meta.has_initial_state,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), out.stride(0), out.stride(1), ssm_state.stride(0), dk**-0.5,
        GROUP=hv // hk, DK=dk, DV=dv, L2NORM=l2norm,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=RECURRENT_BLOCK_V, num_warps=4,
    )  # fmt: skip
    return out

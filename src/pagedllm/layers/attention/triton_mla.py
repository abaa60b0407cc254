"""Multi-head latent attention's GPU kernels in the Triton language (model/mla.py; docs/gpu.md).

- `write_latent`: each new token's cache row [c | k_rope] into its slot (slot < 0: padding, as
  a CUDA graph's padded rows, skipped);
- `mla_decode`: the absorbed decode. Per decode request and group of `BLOCK_H` query heads,
  the scores [q_lat | q_rope] . [c | k_rope] over the request's cached rows (its block table),
  the softmax online in base 2, and the latent mix softmax . c, (heads, kv_lora_rank): every
  head of the request reads the same rows, so one program reads each row once for its
  `BLOCK_H` heads. Split-K over the context as the paged decode kernel (triton_kernels.py),
  whose reduction merges the splits.

The cache is one layer's (num_blocks, block_size, rank + rope), taken through its block and slot
strides (last dimension contiguous). No launch reads a device value on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.layers.attention.triton_kernels import _reduce_splits_kernel, dot_options
from pagedllm.layers.attention.triton_launch import LOG2E, KernelConfig, mla_launch, pow2


@triton.jit
def _write_latent_kernel(
    new_ptr,  # (N, rank + rope)
    cache_ptr,  # (blocks, block_size, rank + rope)
    slot_ptr,  # (N,) int64, < 0 = padding
    stride_n_tok,
    stride_c_block,
    stride_c_slot,
    block_size,
    width,
    BLOCK_W: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    w = tl.arange(0, BLOCK_W)
    # NOTE: the slot test on a full tile: the interpreter mistypes `tile & scalar`
    mask = (w < width) & ((w * 0 + slot) >= 0)
    x = tl.load(new_ptr + tok.to(tl.int64) * stride_n_tok + w, mask=mask)
    dst = cache_ptr + (slot // block_size) * stride_c_block + (slot % block_size) * stride_c_slot
    tl.store(dst + w, x, mask=mask)


def write_latent(new: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store `new` (N, rank + rope) into `cache` (blocks, block_size, rank + rope) at
    `slot_mapping` (N,) int64; rows whose slot is < 0 are not written."""
    n, width = new.shape
    assert new.stride(-1) == 1 and cache.stride(-1) == 1 and new.dtype == cache.dtype
    if n == 0:
        return
    _write_latent_kernel[(n,)](
        new,
        cache,
        slot_mapping,
        new.stride(0),
        cache.stride(0),
        cache.stride(1),
        cache.shape[1],
        width,
        BLOCK_W=triton.next_power_of_2(width),
    )


@triton.jit
def _mla_decode_kernel(
    q_ptr,  # (D, heads, rank + rope): [q_lat | q_rope] per head
    cache_ptr,  # (blocks, block_size, rank + rope): [c | k_rope] per token
    block_tables_ptr,  # (D, max_blocks) int32 or int64
    context_lens_ptr,  # (D,) int32; 0 = padding row (output 0)
    out_ptr,  # (D, heads, rank), used without SPLIT
    part_out_ptr,  # (D, heads, splits, BLOCK_D) fp32, normalized partial outputs
    part_lse_ptr,  # (D, heads, splits) fp32, log2-sum-exp2 of each split's scores
    qk_scale,  # the softmax scale times log2(e)
    stride_q_tok,
    stride_q_head,
    stride_c_block,
    stride_c_slot,
    stride_bt,
    stride_o_tok,
    stride_o_head,
    block_size,
    heads,
    rank,
    rope,
    SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr,  # query heads per program (>= 16 for tl.dot)
    BLOCK_N: tl.constexpr,  # cached rows per iteration
    BLOCK_D: tl.constexpr,  # the latent's width (rank), padded to a power of two
    BLOCK_P: tl.constexpr,  # the rotated key's (rope)
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    r = tl.program_id(0)
    head_group = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    ctx = tl.load(context_lens_ptr + r)
    # this split's rows [lo, hi): equal shares of whole row tiles
    tiles = (ctx + BLOCK_N - 1) // BLOCK_N
    per_split = (tiles + num_splits - 1) // num_splits * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, ctx)

    h = head_group * BLOCK_H + tl.arange(0, BLOCK_H)
    dl = tl.arange(0, BLOCK_D)
    dp = tl.arange(0, BLOCK_P)
    h_mask = h < heads
    l_mask = dl < rank
    p_mask = dp < rope
    q_row = q_ptr + r.to(tl.int64) * stride_q_tok + h[:, None] * stride_q_head
    q_lat = tl.load(q_row + dl[None, :], mask=h_mask[:, None] & l_mask[None, :], other=0.0)
    q_pe = tl.load(q_row + rank + dp[None, :], mask=h_mask[:, None] & p_mask[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    # NOTE: a finite floor for the running max keeps exp2(m_old - m_new) finite for rows that
    # have seen no key yet; masked scores are -inf, so their exp2 is exactly 0.
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + r.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        n_mask = pos < hi
        block = tl.load(table + pos // block_size, mask=n_mask, other=0).to(tl.int64)
        row = cache_ptr + block * stride_c_block + (pos % block_size) * stride_c_slot
        c = tl.load(row[:, None] + dl[None, :], mask=n_mask[:, None] & l_mask[None, :], other=0.0)
        k_pe = tl.load(
            row[:, None] + rank + dp[None, :], mask=n_mask[:, None] & p_mask[None, :], other=0.0
        )
        if UPCAST:
            c = c.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)  # (BLOCK_H, BLOCK_N)
        s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=PRECISION) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
        m_i = m_new

    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc / safe_l[:, None]  # rows without keys: 0
    if not SPLIT:
        o_off = r.to(tl.int64) * stride_o_tok + h[:, None] * stride_o_head + dl[None, :]
        o_mask = h_mask[:, None] & l_mask[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        part = (r.to(tl.int64) * heads + h) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + dl[None, :], out, mask=h_mask[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=h_mask)


def mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    rank: int,
    scale: float,
    num_splits: int,
    cfg: KernelConfig | None = None,
) -> torch.Tensor:
    """softmax([q_lat | q_rope] . [c | k_rope] * scale) . c for each decode row `r` and head,
    over the first `context_lens[r]` cached rows of block table row `r`: `q` (D, heads,
    rank + rope) -> (D, heads, rank) in q's dtype. `num_splits` (a power of two) is fixed by
    the caller, so a CUDA graph can capture the launch."""
    cfg = cfg or KernelConfig()
    d, heads, width = q.shape
    rope = width - rank
    assert q.stride(-1) == 1 and cache.stride(-1) == 1 and cache.shape[-1] == width
    assert num_splits >= 1 and not num_splits & (num_splits - 1)
    out = torch.empty(d, heads, rank, dtype=q.dtype, device=q.device)
    if d == 0:
        return out
    block_d = pow2(rank)
    upcast, precision = dot_options(q.dtype)
    launch = mla_launch(cfg, q.dtype, rank)
    block_h = launch.block_m
    if num_splits > 1:
        part_out = torch.empty(d, heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(d, heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _mla_decode_kernel[(d, triton.cdiv(heads, block_h), num_splits)](
        q,
        cache,
        block_tables,
        context_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        cache.shape[1],
        heads,
        rank,
        rope,
        SPLIT=num_splits > 1,
        BLOCK_H=block_h,
        BLOCK_N=launch.block_n,
        BLOCK_D=block_d,
        BLOCK_P=pow2(rope),
        UPCAST=upcast,
        PRECISION=precision,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    if num_splits > 1:  # the paged decode's reduction: no sinks
        _reduce_splits_kernel[(d, heads)](
            part_out,
            part_lse,
            out,  # (the sinks: unused)
            out,
            out.stride(0),
            out.stride(1),
            rank,
            num_splits,
            SINKS=False,
            BLOCK_S=pow2(max(num_splits, cfg.max_splits), 1),
            BLOCK_D=block_d,
        )
    return out

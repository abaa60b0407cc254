"""The prefill / chunked-prefill attention kernel in the Triton language (see
triton_kernels.py for what every kernel shares, docs/gpu.md for the grid)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.layers.attention.triton_kernels import LOG2E_C, dot_options
from pagedllm.layers.attention.triton_launch import (
    FP8_DTYPES,
    KernelConfig,
    fp8_scales,
    pow2,
    prefill_launch,
)

# --- prefill / chunked prefill ---------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    q_ptr,  # (N, heads, head_dim)
    cache_ptr,
    block_tables_ptr,  # (R, max_blocks) int32
    query_start_ptr,  # (R + 1,) int32
    context_lens_ptr,  # (R,) int32
    tile_request_ptr,  # (T,) int32: the request of each query tile
    tile_row_ptr,  # (T,) int32: the tile's first query row, within its request
    out_ptr,
    sinks_ptr,  # (heads,) fp32 sink logits; used when SINKS
    qk_scale,  # q.k times this (triton_launch.fp8_scales; k_scale included)
    softcap_log2,  # soft-cap * log2(e); used when SOFTCAP
    v_scale,  # an fp8 cache's (triton_launch.fp8_scales); used when KV_FP8
    stride_q_tok,
    stride_q_head,
    stride_c_block,
    stride_c_kv,
    stride_c_head,
    stride_c_slot,
    stride_bt,
    stride_o_tok,
    stride_o_head,
    block_size,
    head_dim,
    group,
    window,  # query at position p sees keys (p - window, p]; used when USE_WINDOW
    USE_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    r = tl.load(tile_request_ptr + tile)
    # a host tile of `prefill_block_m` rows runs as programs of BLOCK_M rows (grid axis 2)
    row0 = tl.load(tile_row_ptr + tile) + tl.program_id(2) * BLOCK_M
    q_start = tl.load(query_start_ptr + r)
    q_len = tl.load(query_start_ptr + r + 1) - q_start
    if row0 >= q_len:  # the host tile's rows end before this program's
        return
    ctx = tl.load(context_lens_ptr + r)
    prefix = ctx - q_len  # cached tokens before this chunk

    rows = row0 + tl.arange(0, BLOCK_M)
    r_mask = rows < q_len
    q_pos = prefix + rows  # (BLOCK_M,) positions of the queries
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    tok = (q_start + rows).to(tl.int64)
    q_off = tok[:, None] * stride_q_tok + head * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_off, mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # keys [lo, hi): up to the tile's last query (causal), from its first query's window
    hi = tl.minimum(ctx, prefix + row0 + BLOCK_M)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(prefix + row0 - window + 1, 0)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + r.to(tl.int64) * stride_bt
    kv_base = cache_ptr + (head // group) * stride_c_head
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        p_mask = pos < hi
        block = tl.load(table + pos // block_size, mask=p_mask, other=0).to(tl.int64)
        slot_off = block * stride_c_block + (pos % block_size) * stride_c_slot
        kv_off = slot_off[:, None] + d[None, :]
        kv_mask = p_mask[:, None] & d_mask[None, :]
        k = tl.load(kv_base + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(kv_base + stride_c_kv + kv_off, mask=kv_mask, other=0.0)
        if KV_FP8:  # widened to q's dtype (triton_kernels.py)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        if SOFTCAP:  # before the mask, as the reference
            s = softcap_log2 * (2.0 / (1.0 + tl.exp2(-s)) - 1.0)
        visible = p_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if SINKS:  # one more key without a value (see triton_kernels.py)
        sink = tl.load(sinks_ptr + head) * LOG2E_C
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2(sink - m_new)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:  # the values were read as stored, v / v_scale
        out = out * v_scale
    o_off = tok[:, None] * stride_o_tok + head * stride_o_head + d[None, :]
    tl.store(
        out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :]
    )


def paged_prefill(
    out: torch.Tensor,
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    tile_request: torch.Tensor,
    tile_row: torch.Tensor,
    scale: float,
    window: int | None = None,
    cfg: KernelConfig | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Causal attention of every tile's query rows (see `prefill_tiles`, built with
    `cfg.prefill_block_m`) over its request's first `context_lens[r]` cached slots, the last
    `q_len` of which are the chunk's own tokens (with a `window`, the last `window` up to each
    query; scores soft-capped with a `softcap`; `sinks`, fp32 (heads,), in each head's
    denominator; an fp8 cache's keys and values times `kv_scales`)."""
    cfg = cfg or KernelConfig()
    _, heads, head_dim = q.shape
    group = heads // cache.shape[2]
    num_tiles = tile_request.shape[0]
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and cache.stride(-1) == 1
    if num_tiles == 0:
        return out
    upcast, precision = dot_options(q.dtype)
    launch = prefill_launch(cfg, q.dtype, head_dim)
    _prefill_kernel[(num_tiles, heads, cfg.prefill_block_m // launch.block_m)](
        q,
        cache,
        block_tables,
        query_start_loc,
        context_lens,
        tile_request,
        tile_row,
        out,
        out if sinks is None else sinks,  # (unused without sinks)
        *fp8_scales(cache, scale, softcap, kv_scales),
        q.stride(0),
        q.stride(1),
        *cache.stride()[:4],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        cache.shape[3],
        head_dim,
        group,
        window or 0,
        USE_WINDOW=window is not None,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        KV_FP8=cache.dtype in FP8_DTYPES,
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        BLOCK_D=pow2(head_dim),
        UPCAST=upcast,
        PRECISION=precision,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out

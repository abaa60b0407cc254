"""Paged-attention kernels in the Triton language (the GPU path); see docs/gpu.md.

Three kernels, plus the split-K reduction (this file: the first two; triton_prefill.py):

- `write_kv`: the new keys/values of a step into their cache slots (slot < 0: padding, skipped);
  into an fp8 cache (kv_cache_dtype fp8_e4m3 / fp8_e5m2) saturated and cast, which the
  attention kernels widen back to the queries' dtype as they load them (`KV_FP8`);
- `paged_decode`: one query token per request over its block table, the query heads of one KV
  head together (GQA) as the rows of one tile, optionally split over the context (split-K);
- `paged_prefill`: causal varlen attention of each prefill chunk over its cached prefix plus
  itself, tiles of query rows of one head.

Tiles, warps and stages come from triton_launch.py's table.

Every kernel takes the cache through five strides (block, k/v, kv head, slot in block, dim), so
any layout whose last dimension is contiguous works: the backend's own head-major layout and a
permuted view of the reference layout alike. Keys are looked up slot by slot through the block
table (`pos // block_size`), so a key tile (`BLOCK_N`) is independent of the block size.

A layer's features are constexpr switches of the attention kernels, chosen per launch from its
`AttnLayer`: `USE_WINDOW` (a sliding window: the key loop starts where the window does) and
`SOFTCAP` (logits capped as cap * tanh(s / cap) before the mask, see
triton_launch.score_scales) and `SINKS` (a learned logit per query head joins each row's
softmax denominator once, after the key loop, as one more key without a value, under the new
running max max(m, sink): nothing overflows, and a row without keys gets output 0); a layer
without them runs a kernel compiled without their code. An fp8 cache's scales
(`AttnLayer.k_scale` / `v_scale`) are runtime values: the write divides by them, the scores'
scale carries k_scale and the output v_scale (triton_launch.fp8_scales).

No launch reads a device value on the host: grids depend on host-known sizes only.

NOTE: under the interpreter (`TRITON_INTERPRET=1`, decided when this module is imported) bf16
tiles are stored as raw 16-bit integers and `tl.dot` on them is wrong, so bf16 operands are
widened to fp32 before each dot there (`UPCAST`); fp16 and fp32 run the exact GPU code path.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from pagedllm.layers.attention.triton_launch import (
    FP8_DTYPES,
    LOG2E,
    KernelConfig,
    decode_launch,
    fp8_scales,
    pow2,
)

INTERPRETED = bool(triton.knobs.runtime.interpret)
LOG2E_C: tl.constexpr = tl.constexpr(LOG2E)  # the kernels' copy (a global they may read)


def dot_options(dtype: torch.dtype) -> tuple[bool, str | None]:
    """(UPCAST, input precision): fp32 dots in IEEE fp32 (tf32 would lose greedy parity)."""
    upcast = INTERPRETED and dtype == torch.bfloat16
    return upcast, "ieee" if dtype == torch.float32 else None


# --- KV-cache write --------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    kv_ptr,  # (N, 2, kv_heads, head_dim)
    cache_ptr,
    slot_ptr,  # (N,) int64, < 0 = padding
    stride_kv_tok,
    stride_kv_kv,
    stride_kv_head,
    stride_c_block,
    stride_c_kv,
    stride_c_head,
    stride_c_slot,
    block_size,
    head_dim,
    k_scale,  # an fp8 cache: keys stored as k / k_scale (AttnLayer); else unused
    v_scale,
    FP8_MAX: tl.constexpr,  # an fp8 cache: its largest finite value; else 0
    FP8_EMIN: tl.constexpr,  # its smallest normal exponent
    FP8_MBITS: tl.constexpr,  # its mantissa bits
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    which = tl.program_id(1)  # 0 = key, 1 = value
    head = tl.program_id(2)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    d = tl.arange(0, BLOCK_D)
    # NOTE: the slot test is made on a full tile: the interpreter mistypes `tile & scalar`
    mask = (d < head_dim) & ((d * 0 + slot) >= 0)
    src = kv_ptr + tok.to(tl.int64) * stride_kv_tok + which * stride_kv_kv + head * stride_kv_head
    x = tl.load(src + d, mask=mask)
    dst = (
        cache_ptr
        + block * stride_c_block
        + which * stride_c_kv
        + head * stride_c_head
        + offset * stride_c_slot
    )
    if FP8_MAX > 0:
        # saturated and rounded to the nearest fp8 value (ties to even), still in fp32, so
        # that the cast below is exact. NOTE: the interpreter's own fp32 -> fp8 cast neither
        # carries a rounded-up mantissa into the exponent nor rounds ties to even; this gives
        # the GPU's and torch's bits there too. The quantum of |x|'s binade (of the smallest
        # normal one for subnormals) is built from its exponent bits; adding and subtracting
        # 1.5 * 2^23 quanta rounds |x| to a multiple of it in fp32 arithmetic; the sign bit is
        # put back after (a negative x rounded to 0 is -0, as torch's).
        x = x.to(tl.float32) / tl.where(which == 0, k_scale, v_scale)
        bits = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX).to(tl.uint32, bitcast=True)
        sign = bits & 0x80000000
        exp = tl.maximum(((bits >> 23) & 0xFF).to(tl.int32) - 127, FP8_EMIN) - FP8_MBITS
        magic = ((exp + 127) << 23).to(tl.float32, bitcast=True) * 12582912.0
        a = (bits ^ sign).to(tl.float32, bitcast=True)
        x = (((a + magic) - magic).to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    tl.store(dst + d, x.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    kv: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Store `kv` (N, 2, kv_heads, head_dim) into `cache` (blocks, 2, kv_heads, block_size,
    head_dim; any strides, last one 1) at `slot_mapping` (N,) int64; into an fp8 cache divided
    by `scales` (k_scale, v_scale), saturated and cast."""
    n, _, kv_heads, head_dim = kv.shape
    fp8 = cache.dtype in FP8_DTYPES
    assert kv.stride(-1) == 1 and cache.stride(-1) == 1 and (fp8 or kv.dtype == cache.dtype)
    if n == 0:
        return
    _write_kv_kernel[(n, 2, kv_heads)](
        kv,
        cache,
        slot_mapping,
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        *cache.stride()[:4],
        cache.shape[3],
        head_dim,
        *scales,
        FP8_MAX=torch.finfo(cache.dtype).max if fp8 else 0.0,
        FP8_EMIN=-6 if cache.dtype == torch.float8_e4m3fn else -14,
        FP8_MBITS=3 if cache.dtype == torch.float8_e4m3fn else 2,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


# --- decode ----------------------------------------------------------------------------------


@triton.jit
def _decode_kernel(
    q_ptr,  # (D, heads, head_dim): one token per request
    cache_ptr,
    block_tables_ptr,  # (R, max_blocks) int32
    context_lens_ptr,  # (R,) int32; 0 = padding row (output 0)
    out_ptr,  # (D, heads, head_dim), used without SPLIT
    part_out_ptr,  # (D, heads, splits, BLOCK_D) fp32, normalized partial outputs
    part_lse_ptr,  # (D, heads, splits) fp32, log2-sum-exp2 of each split's scores
    sinks_ptr,  # (heads,) fp32 sink logits; used when SINKS (and not SPLIT: the reduction's)
    qk_scale,  # q.k times this (triton_launch.fp8_scales: an fp8 cache's k_scale included)
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
    group,  # query heads per kv head
    window,  # sliding window (keys in [ctx - window, ctx)); used when USE_WINDOW
    SPLIT: tl.constexpr,  # the context is split over the grid's third axis
    USE_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,  # an fp8 cache: keys and values widened to q's dtype once loaded
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    r = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    ctx = tl.load(context_lens_ptr + r)
    first = 0
    if USE_WINDOW:
        first = tl.maximum(ctx - window, 0)
    # this split's keys [lo, hi): equal shares of whole key tiles
    tiles = (ctx - first + BLOCK_N - 1) // BLOCK_N
    per_split = (tiles + num_splits - 1) // num_splits * BLOCK_N
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * group + g
    g_mask = g < group
    d_mask = d < head_dim
    q_off = r.to(tl.int64) * stride_q_tok + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_off, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # NOTE: a finite floor for the running max keeps exp2(m_old - m_new) finite for rows that
    # have seen no key yet; masked scores are -inf, so their exp2 is exactly 0.
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + r.to(tl.int64) * stride_bt
    kv_base = cache_ptr + kv_head * stride_c_head
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        p_mask = pos < hi
        block = tl.load(table + pos // block_size, mask=p_mask, other=0).to(tl.int64)
        slot_off = block * stride_c_block + (pos % block_size) * stride_c_slot
        kv_off = slot_off[:, None] + d[None, :]
        kv_mask = p_mask[:, None] & d_mask[None, :]
        k = tl.load(kv_base + kv_off, mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        v = tl.load(kv_base + stride_c_kv + kv_off, mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_G, BLOCK_N)
        if SOFTCAP:
            s = softcap_log2 * (2.0 / (1.0 + tl.exp2(-s)) - 1.0)
        s = tl.where(p_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if SINKS and not SPLIT:  # split: the sinks join in the reduction, once
        sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0) * LOG2E_C
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2(sink - m_new)
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc / safe_l[:, None]  # rows without keys: 0
    if KV_FP8:  # the values were read as stored, v / v_scale: the sum is linear in them
        out = out * v_scale
    if not SPLIT:
        o_off = r.to(tl.int64) * stride_o_tok + heads[:, None] * stride_o_head + d[None, :]
        tl.store(
            out_ptr + o_off,
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        row = (r.to(tl.int64) * (group * tl.num_programs(1)) + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], out, mask=g_mask[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _reduce_splits_kernel(
    part_out_ptr,  # (D, heads, splits, BLOCK_D) fp32
    part_lse_ptr,  # (D, heads, splits) fp32
    sinks_ptr,  # (heads,) fp32 sink logits; used when SINKS
    out_ptr,
    stride_o_tok,
    stride_o_head,
    head_dim,
    num_splits,
    SINKS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # a power of two >= num_splits
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    row = r.to(tl.int64) * tl.num_programs(1) + h
    s = tl.arange(0, BLOCK_S)
    s_mask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + row * num_splits + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    if SINKS:  # one more term of the denominator, without a value (log2 units)
        sink = tl.load(sinks_ptr + h) * LOG2E_C
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)  # no split saw a key (padding row)
    w = tl.exp2(lse - m)  # (BLOCK_S,): 0 past the splits
    parts_off = (row * num_splits + s[:, None]) * BLOCK_D + d[None, :]
    parts = tl.load(part_out_ptr + parts_off, mask=s_mask[:, None], other=0.0)
    total = tl.sum(w, 0)
    if SINKS:
        total += tl.exp2(sink - m)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    o_off = r.to(tl.int64) * stride_o_tok + h * stride_o_head + d
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def paged_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    window: int | None = None,
    cfg: KernelConfig | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """`out[r]` = attention of `q[r]` (D, heads, head_dim) over the first `context_lens[r]`
    slots of block table row `r` (the last `window` of them with a window; scores soft-capped
    with a `softcap`; `sinks`, fp32 (heads,), in each head's denominator; an fp8 cache's keys
    and values times `kv_scales`). `num_splits` (a power of two) is fixed by the caller, so a
    CUDA graph can capture the launch."""
    cfg = cfg or KernelConfig()
    d, heads, head_dim = q.shape
    kv_heads = cache.shape[2]
    group = heads // kv_heads
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and cache.stride(-1) == 1
    assert num_splits >= 1 and not num_splits & (num_splits - 1)
    if d == 0:
        return out
    block_d = pow2(head_dim)
    upcast, precision = dot_options(q.dtype)
    launch = decode_launch(cfg, q.dtype, head_dim, group)
    if cache.dtype in FP8_DTYPES and head_dim > 128 and cfg.decode_block_n is None:
        # the fp8 tiles and their widened copies of 256-wide heads spill at 32 keys
        # (layers/kv_fp8_compile.py): 16 keys per iteration
        launch = dataclasses.replace(launch, block_n=launch.block_n // 2)
    if num_splits > 1:
        part_out = torch.empty(d, heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(d, heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(d, kv_heads, num_splits)](
        q,
        cache,
        block_tables,
        context_lens,
        out,
        part_out,
        part_lse,
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
        SPLIT=num_splits > 1,
        USE_WINDOW=window is not None,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        KV_FP8=cache.dtype in FP8_DTYPES,
        BLOCK_G=pow2(group),
        BLOCK_N=launch.block_n,
        BLOCK_D=block_d,
        UPCAST=upcast,
        PRECISION=precision,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(d, heads)](
            part_out,
            part_lse,
            out if sinks is None else sinks,
            out,
            out.stride(0),
            out.stride(1),
            head_dim,
            num_splits,
            SINKS=sinks is not None,
            BLOCK_S=pow2(max(num_splits, cfg.max_splits), 1),
            BLOCK_D=block_d,
        )
    return out

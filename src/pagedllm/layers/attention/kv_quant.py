"""Quantized KV caches in PyTorch (pagedllm.kv_cache_dtype): the reference backend's write
and read of int8 (per token and head, the scale beside each row) and fp8 caches; the oracle
of the C++ and Triton kernels' quantized paths.

An int8 cache row (one token's keys, or values, of one KV head) is head_dim int8 values q
then 4 bytes, the fp32 scale s = max(|x|) / 127 (at least the smallest normal float): the
row is q * s, q = round(x / s) (to nearest even). An fp8 row is x / scale cast to fp8
(saturated at the format's largest finite value), read back as fp8 * scale.
"""

from __future__ import annotations

import torch

from pagedllm.kv_cache_dtype import SCALE_BYTES

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_TINY = torch.finfo(torch.float32).tiny


def is_quantized(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.int8 or kv_cache.dtype in _FP8


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """The head_dim of a cache's rows (an int8 row carries its scale after them)."""
    return kv_cache.shape[-1] - (SCALE_BYTES if kv_cache.dtype == torch.int8 else 0)


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """x (..., head_dim) as int8 rows (..., head_dim + 4): the values, then the scale's bytes."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / 127).clamp_min(_TINY)
    q = torch.round(xf / scale).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_int8(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows (..., head_dim + 4) -> (..., head_dim) in `dtype` (computed in fp32)."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (rows[..., :head_dim].float() * scale).to(dtype)


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    top = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-top, top).to(dtype)


def _kv_scales(kv: torch.Tensor, scales: tuple[float, float]) -> torch.Tensor:
    # (k_scale, v_scale) shaped to broadcast over (..., 2, kv_heads, head_dim)
    return torch.tensor(scales, dtype=torch.float32, device=kv.device).view(2, 1, 1)


def write(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv: torch.Tensor,
    scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Store each token's keys and values `kv` (N, 2, kv_heads, head_dim) in its slot of a
    (num_blocks, block_size, 2, kv_heads, row) cache, quantized as the cache's dtype says
    (fp8: divided by `scales`, (k_scale, v_scale))."""
    flat = kv_cache.view(-1, *kv_cache.shape[2:])
    if kv_cache.dtype == torch.int8:
        rows = quantize_int8(kv)
    elif kv_cache.dtype in _FP8:  # copied as bytes: index_copy_ has no fp8 kernel everywhere
        rows = quantize_fp8(kv.float() / _kv_scales(kv, scales), kv_cache.dtype)
        rows = rows.view(torch.uint8)
        flat = flat.view(torch.uint8)
    else:
        rows = kv
    flat.index_copy_(0, slot_mapping, rows)


def gather_blocks(
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    dtype: torch.dtype,
    scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """The blocks `block_ids` of a cache, (len(block_ids), block_size, 2, kv_heads, head_dim),
    dequantized to `dtype` (a copy; the cache's own dtype: the blocks as they are; fp8:
    times `scales`, (k_scale, v_scale))."""
    if kv_cache.dtype in _FP8:
        raw = kv_cache.view(torch.uint8).index_select(0, block_ids).view(kv_cache.dtype)
        if scales == (1.0, 1.0):
            return raw.to(dtype)
        return (raw.float() * _kv_scales(raw, scales)).to(dtype)
    blocks = kv_cache.index_select(0, block_ids)
    return dequantize_int8(blocks, dtype) if kv_cache.dtype == torch.int8 else blocks

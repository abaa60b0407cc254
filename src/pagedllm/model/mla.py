"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of compressed latents.

Per token the cache holds one row of `kv_lora_rank + qk_rope_head_dim` values: the normed
latent c (kv_a_layernorm of kv_a_proj_with_mqa's first `kv_lora_rank` outputs), then the rotated
key k_rope shared by every head. Layout per layer: (num_blocks, block_size, cache_dim), so a
request's context is gathered by whole blocks as the torch reference backend gathers K/V.

kv_b_proj holds per head h the rows W_uk[h] (qk_nope_head_dim, rank) and W_uv[h] (v_head_dim,
rank): k_nope = W_uk c, v = W_uv c. Two ways to attend, equal up to rounding:
- expanded (prefill chunks): every context token's k_nope and v per head from its latent, then
  ordinary attention with keys [k_nope | k_rope] - a chunk's queries share the expansion;
- absorbed (decodes): W_uk folds into the query, q_lat = W_uk^T q_nope, so scores are
  [q_lat | q_rope] . [c | k_rope] against the cache itself (one shared "head", no expansion),
  and the output is W_uv (softmax . c), then o_proj. Per step it costs O(heads * rank) per
  context token instead of expanding O(heads * (nope + v) * rank) per context token.

The rotation pairs are interleaved (2i, 2i+1), as the rest of the decoder's; a checkpoint with
half-split rope rows is permuted at load (model/layout.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.attention import cpu_kernels
from pagedllm.layers.attention.torch_ref import TorchAttentionMetadata
from pagedllm.layers.quant import Weight, linear

if TYPE_CHECKING:
    from collections.abc import Callable

    from pagedllm.config import ModelConfig
    from pagedllm.layers.attention.mla_backend import MlaTritonMetadata
    from pagedllm.mla_config import MlaConfig


class _Norm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))


class MlaAttention(nn.Module):
    """MLA's parameters, named as transformers' DeepseekV3Attention names them (this rank's
    heads under tensor parallelism; the latent projection and its norm whole on every rank)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        mla, h, hidden, bias = cfg.mla, cfg.num_heads, cfg.hidden_size, cfg.o_bias
        assert mla is not None
        q_out = h * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = _Norm(mla.q_lora_rank)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.cache_dim, bias=bias)
        self.kv_a_layernorm = _Norm(mla.kv_lora_rank)
        kv_out = h * (mla.qk_nope_head_dim + mla.v_head_dim)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, kv_out, bias=False)
        self.o_proj = nn.Linear(h * mla.v_head_dim, hidden, bias=bias)


class MlaWeights(NamedTuple):
    q_a_w: Weight | None  # None: q_proj straight from the hidden state (q_b_w is q_proj's)
    q_a_b: torch.Tensor | None
    q_a_norm: torch.Tensor | None
    q_b_w: Weight
    kv_a_w: Weight
    kv_a_b: torch.Tensor | None
    kv_a_norm: torch.Tensor
    w_uk: torch.Tensor  # (heads, qk_nope_head_dim, rank): kv_b_proj's key rows per head
    w_uv: torch.Tensor  # (heads, v_head_dim, rank): its value rows


def mla_weights(
    attn: MlaAttention, mla: MlaConfig, w: Callable[[str], Weight], prefix: str
) -> MlaWeights:
    """A layer's MLA weights as the forward pass takes them (`w`: a parameter, or its quantized
    weight, by name; `prefix`: "layers.{i}.self_attn"). kv_b_proj stays dense: both ways of
    attending multiply by its per-head blocks."""
    lora = mla.q_lora_rank is not None
    kv_b = attn.kv_b_proj.weight.view(-1, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
    return MlaWeights(
        w(f"{prefix}.q_a_proj.weight") if lora else None,
        attn.q_a_proj.bias if lora else None,
        attn.q_a_layernorm.weight if lora else None,
        w(f"{prefix}.q_b_proj.weight" if lora else f"{prefix}.q_proj.weight"),
        w(f"{prefix}.kv_a_proj_with_mqa.weight"),
        attn.kv_a_proj_with_mqa.bias,
        attn.kv_a_layernorm.weight,
        kv_b[:, : mla.qk_nope_head_dim],
        kv_b[:, mla.qk_nope_head_dim :],
    )


def mla_forward(
    x: torch.Tensor,
    w: MlaWeights,
    mla: MlaConfig,
    eps: float,
    rotary: torch.Tensor | None,
    kv_cache: torch.Tensor,
    m: TorchAttentionMetadata | MlaTritonMetadata,
    scale: float,
) -> torch.Tensor:
    """(N, hidden) -> (N, heads * v_head_dim), o_proj's input. Writes the new tokens' latents
    and rotated keys into their slots, then attends: the decodes (the first
    `m.num_decodes` tokens) absorbed (in Triton kernels over a GPU's `MlaTritonMetadata`),
    each prefill chunk expanded. `rotary`: (N, 1, rope/2) complex, None for no rotation."""
    n, rank, nope = x.shape[0], mla.kv_lora_rank, mla.qk_nope_head_dim
    q_in = x
    if w.q_a_w is not None and w.q_a_norm is not None:
        q_in = cpu_kernels.rms_norm(linear(x, w.q_a_w, w.q_a_b), w.q_a_norm, eps)
    q = linear(q_in, w.q_b_w).view(n, -1, mla.qk_head_dim)  # (N, heads, nope + rope)
    q_nope, q_rope = q[..., :nope], _rotate(q[..., nope:], rotary)
    kv_a = linear(x, w.kv_a_w, w.kv_a_b)  # (N, rank + rope)
    latent = cpu_kernels.rms_norm(kv_a[:, :rank].contiguous(), w.kv_a_norm, eps)
    k_rope = _rotate(kv_a[:, None, rank:], rotary)[:, 0]
    new = torch.cat([latent, k_rope], dim=-1).to(kv_cache.dtype)
    d, outs = m.num_decodes, []
    if isinstance(m, TorchAttentionMetadata):
        kv_cache.view(-1, mla.cache_dim).index_copy_(0, m.slot_mapping, new)
    else:  # a GPU: the write and the decodes in Triton kernels (layers/attention/mla_backend.py)
        query = torch.cat([absorb_query(q_nope[:d], w), q_rope[:d]], dim=-1)
        o_lat = m.write_and_decode(new, query, kv_cache, rank, scale)  # (D, heads, rank)
        outs.append(expand_output(o_lat, w))
        if m.prefill is None:  # decodes only
            return outs[0].reshape(n, -1)
        m = m.prefill
    masks = m.masks_for(None)
    if d and not outs:
        blocks = kv_cache.index_select(0, m.decode_block_ids)  # (D * max_blocks, bs, dim)
        ctx = blocks.view(d, -1, mla.cache_dim)  # (D, T, rank + rope)
        outs.append(decode_absorbed(q_nope[:d], q_rope[:d], ctx, masks[0], w, scale))
    for p, mask in zip(m.prefills, masks[1:], strict=True):
        ctx = kv_cache.index_select(0, p.block_ids).view(-1, mla.cache_dim)[: p.ctx_len]
        rows = slice(p.q_start, p.q_start + p.q_len)
        outs.append(attend_expanded(q_nope[rows], q_rope[rows], ctx, mask, w, scale))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(n, -1)


def decode_absorbed(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    ctx: torch.Tensor,
    mask: torch.Tensor,
    w: MlaWeights,
    scale: float,
) -> torch.Tensor:
    """Decodes against the cache itself. q_nope (D, heads, nope), q_rope (D, heads, rope), ctx
    (D, T, rank + rope) gathered rows, mask (D, 1, 1, T) -> (D, heads, v_head_dim)."""
    rank = w.w_uk.shape[-1]
    # (D, 1, heads, rank + rope)
    query = torch.cat([absorb_query(q_nope, w), q_rope], dim=-1)[:, None]
    # heads are the query rows of the one shared key/value "head"; values: the latents
    keys, values = ctx[:, None], ctx[:, None, :, :rank]
    o_lat = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
    return expand_output(o_lat[:, 0], w)


def absorb_query(q_nope: torch.Tensor, w: MlaWeights) -> torch.Tensor:
    """q_lat = W_uk^T q_nope per head: (D, heads, nope) -> (D, heads, rank)."""
    return torch.einsum("dhn,hnr->dhr", q_nope, w.w_uk.to(q_nope.dtype))


def expand_output(o_lat: torch.Tensor, w: MlaWeights) -> torch.Tensor:
    """W_uv times each head's latent mix: (D, heads, rank) -> (D, heads, v_head_dim)."""
    return torch.einsum("dhr,hvr->dhv", o_lat, w.w_uv.to(o_lat.dtype))


def attend_expanded(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    ctx: torch.Tensor,
    mask: torch.Tensor,
    w: MlaWeights,
    scale: float,
) -> torch.Tensor:
    """Queries of one request against its context expanded per head. q_nope (L, heads, nope),
    q_rope (L, heads, rope), ctx (T, rank + rope), mask (L, T) -> (L, heads, v_head_dim)."""
    heads, _, rank = w.w_uk.shape
    latent, k_rope = ctx[:, :rank], ctx[:, rank:]
    k_nope = torch.einsum("tr,hnr->htn", latent, w.w_uk.to(latent.dtype))  # (heads, T, nope)
    v = torch.einsum("tr,hvr->htv", latent, w.w_uv.to(latent.dtype))  # (heads, T, v)
    k = torch.cat([k_nope, k_rope[None].expand(heads, -1, -1)], dim=-1)
    q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # (heads, L, nope + rope)
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1)


def _rotate(t: torch.Tensor, rotary: torch.Tensor | None) -> torch.Tensor:
    """(N, heads, rope) with each head's interleaved pairs times `rotary` (N, 1, rope / 2)
    complex, in fp32, rounded once to t's dtype; a new tensor."""
    if rotary is None:
        return t.contiguous()
    pairs = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rotary).flatten(-2).to(t.dtype)

"""Pure-PyTorch paged attention: the CPU path, and the oracle for the GPU kernels.

Cache layout per layer: (num_blocks, block_size, 2, num_kv_heads, head_dim), keys and values
of a slot side by side so that one write stores both and one gather of whole blocks (large
contiguous copies) fetches a request's context. Decodes are batched into one padded attention
call; prefill chunks attend one request at a time (causal, offset by their cached prefix).
A quantized cache (int8 or fp8, `kv_quant`) is written quantized and read back dequantized to
the queries' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedllm.layers.attention import kv_quant
from pagedllm.layers.attention.base import AttnLayer, StepInputs


@dataclass
class _Prefill:
    q_start: int
    q_len: int
    block_ids: torch.Tensor  # (num_blocks,) the request's blocks covering its context
    ctx_len: int
    q_pos: torch.Tensor  # (q_len, 1) the queries' positions
    k_pos: torch.Tensor  # (1, ctx_len) the keys'


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # (N,)
    num_decodes: int
    decode_block_ids: torch.Tensor  # (D * max_blocks,) block tables of the decodes, flattened
    decode_ctx: torch.Tensor  # (D, 1) the decodes' context lengths
    key_pos: torch.Tensor  # (max_blocks * block_size,) key positions of the decodes' contexts
    prefills: list[_Prefill]
    # the masks (True = attend) per sliding window, built once per step for the first layer
    # that has that window: [decode mask (D, 1, 1, T), then one per prefill]
    masks: dict[int | None, list[torch.Tensor]] = field(default_factory=dict)

    def masks_for(self, window: int | None) -> list[torch.Tensor]:
        masks = self.masks.get(window)
        if masks is None:
            decode = self.key_pos < self.decode_ctx
            if window is not None:
                decode &= self.key_pos >= self.decode_ctx - window
            masks = [decode[:, None, None, :]]
            for p in self.prefills:
                mask = p.k_pos <= p.q_pos
                if window is not None:
                    mask &= p.k_pos > p.q_pos - window
                masks.append(mask)
            self.masks[window] = masks
        return masks


def _gather(
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    n: int,
    dtype: torch.dtype,
    scales: tuple[float, float],
) -> torch.Tensor:
    # whole blocks -> (n, num_blocks_each * block_size, 2, kv_heads, head_dim), a quantized
    # cache's dequantized to `dtype` (fp8: times `scales`)
    if kv_quant.is_quantized(kv_cache):
        blocks = kv_quant.gather_blocks(kv_cache, block_ids, dtype, scales)
        return blocks.view(n, -1, *blocks.shape[2:])
    blocks = kv_cache.flatten(1).index_select(0, block_ids)
    return blocks.view(n, -1, *kv_cache.shape[2:])


class TorchAttentionBackend:
    name = "torch"

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (num_blocks, block_size, 2, num_kv_heads, head_dim)

    def build_metadata(self, step: StepInputs) -> TorchAttentionMetadata:
        device = step.input_ids.device
        d, bs = step.num_decodes, step.block_size
        ctx = torch.tensor(step.context_lens[:d], device=device)
        max_blocks = -(-max(step.context_lens[:d], default=0) // bs)
        return TorchAttentionMetadata(
            slot_mapping=step.slot_mapping,
            num_decodes=d,
            decode_block_ids=step.block_tables[:d, :max_blocks].flatten(),
            decode_ctx=ctx[:, None],
            key_pos=torch.arange(max_blocks * bs, device=device),
            prefills=[self._prefill(step, r) for r in range(d, len(step.context_lens))],
        )

    @staticmethod
    def _prefill(step: StepInputs, r: int) -> _Prefill:
        device = step.input_ids.device
        q_start, q_end = step.query_start_loc[r], step.query_start_loc[r + 1]
        q_len, ctx_len = q_end - q_start, step.context_lens[r]
        num_blocks = -(-ctx_len // step.block_size)
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
        k_pos = torch.arange(ctx_len, device=device)[None, :]
        return _Prefill(q_start, q_len, step.block_tables[r, :num_blocks], ctx_len, q_pos, k_pos)

    def decode_batch(self, metadata: TorchAttentionMetadata) -> None:
        return None  # no fused CPU decode

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        layer: AttnLayer,
    ) -> torch.Tensor:
        m = metadata
        scales = (layer.k_scale, layer.v_scale)
        kv_quant.write(kv_cache, m.slot_mapping, kv, scales)
        _, num_heads, head_dim = q.shape
        num_kv_heads = kv.shape[2]
        group = num_heads // num_kv_heads
        d = m.num_decodes
        masks = m.masks_for(layer.window)
        outs = []
        if d:
            # GQA without copies: the query heads of one KV head act as its query rows.
            # (D, kv, group, hd) x (D, kv, T, hd) -> (D, kv, group, hd)
            ctx = _gather(kv_cache, m.decode_block_ids, d, q.dtype, scales)
            qd = q[:d].view(d, num_kv_heads, group, head_dim)
            k, v = ctx[:, :, 0].transpose(1, 2), ctx[:, :, 1].transpose(1, 2)
            o = _attend(qd, k, v, masks[0], layer, False)
            outs.append(o.reshape(d, num_heads, head_dim))  # CUDA kernels may permute it
        for p, mask in zip(m.prefills, masks[1:], strict=True):
            # (1, heads, L, hd) x (1, kv, T, hd), causal after the cached prefix
            ctx = _gather(kv_cache, p.block_ids, 1, q.dtype, scales)[0, : p.ctx_len]
            qp = q[p.q_start : p.q_start + p.q_len].transpose(0, 1)[None]
            k, v = ctx[:, 0].transpose(0, 1)[None], ctx[:, 1].transpose(0, 1)[None]
            o = _attend(qp, k, v, mask, layer, group > 1)
            outs.append(o[0].transpose(0, 1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    layer: AttnLayer,
    gqa: bool,
) -> torch.Tensor:
    """softmax(q k^T * scale [soft-capped], masked [, sinks]) v; without a soft-cap or sinks,
    torch's fused attention."""
    if layer.softcap is None and layer.sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=layer.scale, enable_gqa=gqa
        )
    if gqa:  # (1, kv, T, hd) -> (1, heads, T, hd)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * layer.scale
    if layer.softcap is not None:
        cap = layer.softcap
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    if layer.sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        # one more column per query, its head's sink logit, dropped after the softmax. Rows
        # are heads: q (D, kv, group, hd) for the decodes, (1, heads, L, hd) for a prefill
        sinks = layer.sinks.float().view(q.shape[1], -1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)

"""Pure-PyTorch paged attention: the CPU path, and the oracle for the GPU kernels.

Each step gathers every request's context from the paged cache by slot index (computed once
per step, reused by all layers). Decodes are batched into one padded attention call; prefill
chunks attend one request at a time (causal, offset by their cached prefix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.layers.attention.base import StepInputs


@dataclass
class _Prefill:
    q_start: int
    q_len: int
    ctx_slots: torch.Tensor  # (T,) slots of the whole context, new tokens included
    mask: torch.Tensor  # (q_len, T) bool, True = attend


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_ctx_slots: torch.Tensor  # (D, T_max) slots, padded with slot 0
    decode_mask: torch.Tensor  # (D, 1, 1, T_max) bool
    prefills: list[_Prefill]


def _context_slots(block_table: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    # (..., max_blocks) -> (..., length): the slot of every context position
    offsets = torch.arange(block_size, device=block_table.device)
    slots = (block_table.unsqueeze(-1) * block_size + offsets).flatten(-2)
    return slots[..., :length]


class TorchAttentionBackend:
    name = "torch"

    def build_metadata(self, step: StepInputs) -> TorchAttentionMetadata:
        device = step.input_ids.device
        d = step.num_decodes
        window = step.sliding_window
        ctx = torch.tensor(step.context_lens[:d], device=device)
        t_max = max(step.context_lens[:d], default=0)
        decode_slots = _context_slots(step.block_tables[:d], step.block_size, t_max)
        key_pos = torch.arange(t_max, device=device)
        mask = key_pos < ctx[:, None]
        if window is not None:
            mask &= key_pos >= (ctx - window)[:, None]
        prefills = []
        for r in range(d, len(step.context_lens)):
            q_start, q_end = step.query_start_loc[r], step.query_start_loc[r + 1]
            prefills.append(
                self._prefill(step, r, q_start, q_end - q_start, step.context_lens[r], window)
            )
        return TorchAttentionMetadata(
            step.slot_mapping, d, decode_slots, mask[:, None, None, :], prefills
        )

    @staticmethod
    def _prefill(
        step: StepInputs, r: int, q_start: int, q_len: int, ctx_len: int, window: int | None
    ) -> _Prefill:
        device = step.input_ids.device
        slots = _context_slots(step.block_tables[r], step.block_size, ctx_len)
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
        k_pos = torch.arange(ctx_len, device=device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        return _Prefill(q_start, q_len, slots, mask)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        m = metadata
        k_cache.index_copy_(0, m.slot_mapping, k)
        v_cache.index_copy_(0, m.slot_mapping, v)
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        d = m.num_decodes
        if d:
            # GQA without copies: the query heads of one KV head act as its query rows.
            # (D, kv, group, hd) x (D, kv, T, hd) -> (D, kv, group, hd)
            qd = q[:d].view(d, num_kv_heads, group, head_dim)
            kd = k_cache[m.decode_ctx_slots].transpose(1, 2)
            vd = v_cache[m.decode_ctx_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=m.decode_mask, scale=scale)
            out[:d] = o.reshape(d, num_heads, head_dim)
        for p in m.prefills:
            # (1, heads, L, hd) x (1, kv, T, hd), causal with the cached prefix before it
            qp = q[p.q_start : p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)
            kp = k_cache[p.ctx_slots].transpose(0, 1).unsqueeze(0)
            vp = v_cache[p.ctx_slots].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=p.mask, scale=scale, enable_gqa=group > 1
            )
            out[p.q_start : p.q_start + p.q_len] = o[0].transpose(0, 1)
        return out

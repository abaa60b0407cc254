"""Mixture-of-experts: the experts of one layer and their computation over routed tokens.

Each token goes to `k` experts (ids `topk_ids` (N, k)) with weights `topk_weights` (N, k)
(fp32), chosen by the model's router (model/moe_block.py). An expert is a gated MLP:
`down(act(gate(x)) * up(x))`, with optional biases; every expert's weights are stacked along a
leading expert dim:

- `w13` (E, 2I, H): each expert's gate rows, then its up rows (as the dense MLP's gate_up);
- `w2` (E, H, I);
- `b13` (E, 2I) and `b2` (E, H), or None;
- a `QuantizedWeight` holds the same with the expert dim leading each of its tensors
  (`qweight` (E, N, ...), `scales` (E, N, groups), `mins`).

`fused_experts` runs them all in one computation: the C++ kernel on the CPU
(csrc/moe.cpp), the Triton kernel on a GPU (layers/moe_triton.py); `experts_loop` is the
per-expert Python loop that both are checked against (and that the benchmark races).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.layers.quant import QuantizedWeight, Weight, linear

# the gated activations: "silu" (SwiGLU), "gelu_tanh", "gelu", and gpt-oss's clamped SwiGLU
# ("swiglu_oai": gate clamped above at `limit`, up to [-limit, limit], then
# (up + 1) * gate * sigmoid(alpha * gate))
ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "swiglu_oai")
OAI_ALPHA = 1.702


@dataclass(frozen=True)
class Experts:
    w13: Weight
    w2: Weight
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    activation: str = "silu"
    limit: float = 7.0  # swiglu_oai's clamp

    @property
    def num_experts(self) -> int:
        return expert_shape(self.w13)[0]

    def expert(self, e: int) -> tuple[Weight, torch.Tensor | None, Weight, torch.Tensor | None]:
        """Expert `e`'s (w13, b13, w2, b2), each a 2-D weight (or 1-D bias)."""
        b13 = None if self.b13 is None else self.b13[e]
        b2 = None if self.b2 is None else self.b2[e]
        return select_expert(self.w13, e), b13, select_expert(self.w2, e), b2


def expert_shape(w: Weight) -> tuple[int, ...]:
    return tuple((w.qweight if isinstance(w, QuantizedWeight) else w).shape)


def select_expert(w: Weight, e: int) -> Weight:
    if not isinstance(w, QuantizedWeight):
        return w[e]
    mins = None if w.mins is None else w.mins[e]
    return QuantizedWeight(w.bits, w.qweight[e], w.scales[e], mins)


def gated_act(gate_up: torch.Tensor, activation: str, limit: float = 7.0) -> torch.Tensor:
    """(M, 2I) -> (M, I): act(gate) * up for `gate, up = gate_up.chunk(2, -1)`."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "swiglu_oai":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * OAI_ALPHA))
    approximate = "tanh" if activation == "gelu_tanh" else "none"
    return F.gelu(gate, approximate=approximate) * up


def experts_loop(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: Experts
) -> torch.Tensor:
    """The experts one by one (a Python loop over those with tokens): (N, H) -> (N, H) in x's
    dtype, each token's expert outputs weighted and summed (in fp32)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=experts.num_experts).tolist()
    tokens = order // topk_ids.shape[1]
    weights = topk_weights.reshape(-1)[order]
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        w13, b13, w2, b2 = experts.expert(e)
        h = gated_act(linear(x[rows], w13, b13), experts.activation, experts.limit)
        y = linear(h, w2, b2).float() * weights[start : start + count, None]
        out.index_add_(0, rows, y)
        start += count
    return out.to(x.dtype)


def quantize_experts(w: torch.Tensor, method: str) -> QuantizedWeight:
    """Stacked dense experts (E, N, K) -> one `QuantizedWeight` with the expert dim leading
    each of its tensors (each expert quantized as a 2-D weight, in rows: never packed)."""
    from pagedllm.layers.quant import quantize

    parts = [quantize(e, method) for e in w]
    mins = [p.mins for p in parts if p.mins is not None]
    return QuantizedWeight(
        parts[0].bits,
        torch.stack([p.qweight for p in parts]),
        torch.stack([p.scales for p in parts]),
        torch.stack(mins) if mins else None,
    )

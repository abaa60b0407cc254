"""The mixture-of-experts block that replaces a layer's MLP (Mixtral, Qwen2/3-MoE, gpt-oss):
a router picks each token's top-k experts and their weights; the experts run as one fused
computation (layers/moe.py); a shared expert, where the family has one, joins every token's
output through a sigmoid gate.

Under tensor parallelism every expert is split like the dense MLP (each rank holds a slice of
every expert's intermediate dim: its gate/up rows and down columns), the router and the
shared gate are replicated (every rank routes the same), and the block's partial outputs
(experts and shared expert together) take one all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.layers.moe import Experts, experts_loop, gated_act
from pagedllm.layers.quant import Weight, linear
from pagedllm.moe_config import MoeConfig

if TYPE_CHECKING:
    from pagedllm.distributed.comm import TPGroup
    from pagedllm.distributed.shard import ShardPlan


class Stacked(nn.Module):
    """Every expert's weight of one projection, stacked: (E, rows, cols), bias (E, rows)."""

    def __init__(self, experts: int, rows: int, cols: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, rows, cols))
        self.bias = nn.Parameter(torch.empty(experts, rows)) if bias else None


class MoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: MoeConfig) -> None:
        """`cfg` and `moe`: this rank's sizes."""
        super().__init__()
        h, e, i = cfg.hidden_size, moe.num_experts, moe.intermediate_size
        self.router = nn.Linear(h, e, bias=moe.router_bias)
        if moe.router == "sigmoid_grouped":  # held in fp32, as transformers holds them
            self.score_bias = nn.Parameter(torch.empty(e))  # selection only
            for p in (self.router.weight, self.score_bias):
                p.keep_fp32 = True  # type: ignore[attr-defined]  # read by the loader
        self.experts_gate_up = Stacked(e, 2 * i, h, moe.expert_bias)
        self.experts_down = Stacked(e, h, i, moe.expert_bias)
        if s := moe.shared_intermediate_size:
            self.shared_gate_up = nn.Linear(h, 2 * s, bias=False)
            self.shared_down = nn.Linear(s, h, bias=False)
            if moe.shared_gate:
                self.shared_gate = nn.Linear(h, 1, bias=False)


class SharedExpert(NamedTuple):
    gate_up: Weight
    down: Weight
    gate: torch.Tensor | None  # (1, H): its output times sigmoid(gate . x)


class MoeWeights(NamedTuple):
    router_w: torch.Tensor
    router_b: torch.Tensor | None
    experts: Experts
    shared: SharedExpert | None
    score_bias: torch.Tensor | None = None  # sigmoid_grouped: added to the scores to choose


def moe_weights(
    block: MoeBlock,
    moe: MoeConfig,
    get: Callable[[str], Weight],
    prefix: str,
    plan: ShardPlan | None = None,
) -> MoeWeights:
    """The block's weights as the forward pass takes them; `get(name)` gives a (possibly
    quantized) weight by its full parameter name. Under tensor parallelism the experts' down
    biases count on rank 0 only (the ranks' partial outputs are summed)."""
    b2: torch.Tensor | None = block.experts_down.bias
    if b2 is not None and plan is not None and plan.rank != 0:
        b2 = torch.zeros_like(b2)
    experts = Experts(
        get(f"{prefix}.experts_gate_up.weight"),
        get(f"{prefix}.experts_down.weight"),
        block.experts_gate_up.bias,
        b2,
        moe.activation,
        moe.limit,
    )
    shared = None
    if moe.shared_intermediate_size:
        shared = SharedExpert(
            get(f"{prefix}.shared_gate_up.weight"),
            get(f"{prefix}.shared_down.weight"),
            block.shared_gate.weight if moe.shared_gate else None,
        )
    bias = block.score_bias if moe.router == "sigmoid_grouped" else None
    return MoeWeights(block.router.weight, block.router.bias, experts, shared, bias)


def route(
    logits: torch.Tensor, moe: MoeConfig, score_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (N, E), in the model's dtype (fp32 for sigmoid_grouped) -> each token's
    top-k experts' weights (fp32) and ids, computed as transformers does (its dtypes, and
    `torch.topk`'s tie-breaking)."""
    if moe.router == "topk_softmax":  # the top k logits, softmax over them
        values, ids = torch.topk(logits, moe.top_k, dim=-1)
        return torch.softmax(values, dim=-1).float(), ids
    if moe.router == "sigmoid_grouped":
        return _grouped(logits, moe, score_bias)
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    if moe.weights_in_model_dtype:
        weights = weights.to(logits.dtype).float()
    return weights, ids


def _grouped(
    logits: torch.Tensor, moe: MoeConfig, score_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing: groups ranked by the sum of their two best (bias-corrected)
    scores, the experts of the best `topk_group` groups compete for the top k."""
    n, e = logits.shape
    scores = logits.float().sigmoid()
    choice = scores if score_bias is None else scores + score_bias
    per_group = e // moe.n_group
    group_scores = choice.view(n, moe.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    groups = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
    choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling, ids


def fused_experts(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: Experts
) -> torch.Tensor:
    """The experts in one computation where a kernel takes them (C++ on the CPU, Triton on a
    GPU), else expert by expert."""
    out: torch.Tensor | None = None
    if x.device.type == "cpu":
        from pagedllm.layers.moe_cpu import fused_experts_cpu

        out = fused_experts_cpu(x, topk_weights, topk_ids, experts)
    elif x.device.type == "cuda":
        from pagedllm.layers.moe_triton import fused_experts_triton

        out = fused_experts_triton(x, topk_weights, topk_ids, experts)
    return experts_loop(x, topk_weights, topk_ids, experts) if out is None else out


def moe_forward(
    x: torch.Tensor, w: MoeWeights, moe: MoeConfig, activation: str, tp: TPGroup | None
) -> torch.Tensor:
    """(N, H) -> (N, H): the block's output (all-reduced under tensor parallelism).
    `activation`: the shared expert's (the model's MLP activation)."""
    router_x = x.float() if w.router_w.dtype == torch.float32 else x
    weights, ids = route(linear(router_x, w.router_w, w.router_b), moe, w.score_bias)
    out = fused_experts(x, weights, ids, w.experts)
    if w.shared is not None:
        shared = linear(gated_act(linear(x, w.shared.gate_up), activation), w.shared.down)
        if w.shared.gate is not None:
            shared = torch.sigmoid(linear(x, w.shared.gate)) * shared
        out = out + shared
    return out if tp is None else tp.all_reduce(out)

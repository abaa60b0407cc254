"""A hybrid model's Gated-DeltaNet token mixer (Qwen3.5 `linear_attention` layers) in place of
attention, over the kernels of layers/gated_delta.py, and the per-step state it reads: each
request's slot of every linear layer's state pool (core/state_pool.py assigns the slots).

Per layer: one fused input projection (q|k|v of the conv, the output gate z, b, a), the causal
depthwise conv1d with SiLU over q|k|v, the gated delta rule (g = -exp(A_log) softplus(a +
dt_bias), beta = sigmoid(b)), the gated RMSNorm (norm(o) * w * silu(z)) and o_proj. The
decoder names the module `self_attn` and its output projection `o_proj`, as attention's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from pagedllm.layers.gated_delta import (
    GdnState,
    causal_conv1d,
    gated_delta_rule,
    gated_rms_norm,
    gdn_gating,
)
from pagedllm.layers.gdn_meta import GdnMeta
from pagedllm.layers.quant import Weight, linear

if TYPE_CHECKING:
    from pagedllm.config import ModelConfig
    from pagedllm.hybrid_config import HybridConfig


class _Conv(nn.Module):
    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class GdnAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.hybrid is not None
        s = cfg.hybrid.shape
        self.in_proj = nn.Linear(cfg.hidden_size, sum(in_proj_sizes(cfg.hybrid)), bias=False)
        self.conv1d = _Conv(s.conv_dim, s.conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(s.value_heads))
        self.A_log = nn.Parameter(torch.empty(s.value_heads))
        # the gated norm's weight (not a (1 + w) norm: not named `*norm.weight`)
        self.norm_weight = nn.Parameter(torch.empty(s.value_dim))
        self.o_proj = nn.Linear(s.value_heads * s.value_dim, cfg.hidden_size, bias=False)


def in_proj_sizes(hybrid: HybridConfig) -> list[int]:
    """The fused input projection's shards: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a."""
    s = hybrid.shape
    return [s.conv_dim, s.value_heads * s.value_dim, s.value_heads, s.value_heads]


class GdnWeights(NamedTuple):
    in_proj: Weight
    conv: torch.Tensor  # (conv_dim, K)
    dt_bias: torch.Tensor
    a_log: torch.Tensor
    norm: torch.Tensor
    state: int  # the index of this layer's state pool (among the linear layers)


def gdn_weights(
    attn: nn.Module, w: Callable[[str], Weight], layer: int, hybrid: HybridConfig | None
) -> GdnWeights | None:
    """Layer `layer`'s weights (`w`: the model's getter by parameter name, quantized or dense);
    None where it is no linear layer."""
    if not isinstance(attn, GdnAttention) or hybrid is None:
        return None
    conv = attn.conv1d.weight
    return GdnWeights(
        w(f"layers.{layer}.self_attn.in_proj.weight"),
        conv.view(conv.shape[0], -1),
        attn.dt_bias,
        attn.A_log,
        attn.norm_weight,
        sum(hybrid.layer_linear[:layer]),
    )


class GdnStep(NamedTuple):
    """A step's view of the linear layers' states: the requests' slots and token bounds, and
    every linear layer's state pool."""

    meta: GdnMeta
    states: Sequence[GdnState]


def gdn_forward(
    x: torch.Tensor, w: GdnWeights, hybrid: HybridConfig, step: GdnStep, eps: float
) -> torch.Tensor:
    """(N, hidden) -> (N, value_heads * value_dim), before o_proj; updates the requests' slots."""
    s, n = hybrid.shape, x.shape[0]
    state = step.states[w.state]
    mixed, z, b, a = linear(x, w.in_proj).split(in_proj_sizes(hybrid), dim=-1)
    mixed = causal_conv1d(mixed.contiguous(), w.conv, None, state.conv, step.meta, "silu")
    q, k, v = s.split(mixed)
    g, beta = gdn_gating(a, b, w.a_log, w.dt_bias)
    o = gated_delta_rule(q, k, v, g, beta, state.ssm, step.meta)
    o = gated_rms_norm(o, z.reshape(n, s.value_heads, s.value_dim), w.norm, eps)
    return o.reshape(n, -1)


def new_states(
    hybrid: HybridConfig, slots: int, dtype: torch.dtype, device: torch.device
) -> list[GdnState]:
    """Every linear layer's state pool of `slots` requests."""
    return [hybrid.shape.new_state(slots, dtype, device) for _ in range(hybrid.num_linear)]


def build_step(
    query_start_loc: Sequence[int],
    slots: Sequence[int],
    continues: Sequence[bool],
    states: Sequence[GdnState],
    device: torch.device,
) -> GdnStep:
    return GdnStep(GdnMeta.build(query_start_loc, slots, continues, device), states)


def spread_kv_caches(caches: list[torch.Tensor], hybrid: HybridConfig | None) -> list[torch.Tensor]:
    """One KV cache per layer from `caches`, one per attention layer: a linear layer's entry
    is an empty tensor (it keeps its state in the state pool instead)."""
    if hybrid is None:
        return caches
    it = iter(caches)
    empty = caches[0].new_empty(0)
    return [empty if linear else next(it) for linear in hybrid.layer_linear]

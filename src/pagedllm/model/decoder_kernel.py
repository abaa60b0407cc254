"""The decoder's layers as csrc/decoder.cpp's `decode_layers` takes them: every layer's
tensors flattened in its `Slot` order, for the whole decode step in one C++ call (a mixture of
experts included: its router, routing, fused experts and shared expert; DeepSeek's latent
attention (csrc/mla_decode.cpp) and grouped sigmoid router; a step's LoRA adapters too)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from pagedllm.layers.attention import cpu_kernels
from pagedllm.layers.attention.base import DecodeBatch
from pagedllm.layers.attention.torch_ref import TorchAttentionMetadata
from pagedllm.layers.moe import Experts
from pagedllm.layers.moe_cpu import fused_experts_cpu, max_kernel_rows
from pagedllm.layers.quant import QuantizedWeight, Weight, kernel_rows
from pagedllm.model_config import ModelConfig
from pagedllm.moe_config import MoeConfig

if TYPE_CHECKING:
    from pagedllm.lora.ops import LoraStep
    from pagedllm.model.decoder_types import ForwardContext, LayerWeights
    from pagedllm.model.mla import MlaWeights
    from pagedllm.model.moe_block import MoeWeights

# the routers csrc/decoder.cpp runs
ROUTERS = ("softmax", "topk_softmax", "sigmoid_grouped")
MOE_SLOTS, MLA_SLOTS = 25, 16  # csrc/decoder.cpp's kRouter..kScoreBias, mla_decode.cpp's


class Model(Protocol):
    """What `flatten` reads of model/decoder.py's CausalLM."""

    config: ModelConfig
    norm: Any  # its final RMSNorm (`.weight`)
    tp: Any  # its tensor-parallel group, None alone
    layer_weights: list[LayerWeights]


def flatten(model: Model) -> tuple[list[torch.Tensor], float]:
    """The layers' weights flattened for `decode_layers`, and the most decodes it runs (the
    linear kernels' and the experts' row limits); ([], 0) where it cannot run: tensor
    parallelism, not the CPU, no extension, attention, routing or weights the kernels refuse."""
    cfg, norm = model.config, model.norm.weight
    module = cpu_kernels.kernel_module()
    if model.tp is not None or norm.device.type != "cpu" or module is None:
        return [], 0.0
    attn_ok = cpu_kernels.supports_shape(norm.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    if cfg.mla is None and not attn_ok:  # (latent attention runs by ATen ops)
        return [], 0.0
    if cfg.moe is not None and cfg.moe.router not in ROUTERS:
        return [], 0.0
    flat: list[torch.Tensor] = []
    rows = float("inf")
    for w in model.layer_weights:
        layer = _layer(w, norm.dtype, cfg.moe)
        if layer is None:  # the layers run op by op
            return [], 0.0
        flat += layer[0]
        rows = min(rows, layer[1])
    return flat, rows


def decode_batch(ctx: ForwardContext, latent: bool) -> DecodeBatch | None:
    """The step as `decode_layers` takes it, when all its tokens are decodes and the backend
    is the C++ CPU one (`AttentionBackend.decode_batch`) or, for latent attention, the torch
    backend over the cache of latents: its decodes' blocks and context lengths."""
    m = ctx.attn_metadata
    if not latent:
        return ctx.backend.decode_batch(m)
    if not isinstance(m, TorchAttentionMetadata) or m.num_decodes != m.slot_mapping.shape[0]:
        return None  # a prefill chunk among the tokens
    blocks = m.decode_block_ids.view(m.num_decodes, -1)
    return DecodeBatch(m.slot_mapping, blocks, m.decode_ctx.view(-1))


def lora_args(lora: LoraStep | None, dtype: torch.dtype) -> tuple[Any, ...] | None:
    """`decode_layers`' LoRA (its Lora: empty without an adapter in the step); None where it
    cannot add the step's deltas (LoraStep.kernel_args), and the layers run op by op. (Tensor
    parallelism, which shards the adapters, runs op by op anyway: `flatten`.)"""
    if lora is None:
        return [], torch.empty(0, dtype=torch.int64), []
    return lora.kernel_args(dtype)


def moe_args(moe: MoeConfig | None) -> tuple[str, int, bool, bool, str, float, int, int, float]:
    """`decode_layers`' mixture-of-experts settings (its MoeStep); an empty router: none."""
    if moe is None:
        return "", 0, False, False, "silu", 0.0, 1, 1, 1.0
    return (
        moe.router,
        moe.top_k,
        moe.norm_topk_prob,
        moe.weights_in_model_dtype,
        moe.activation,
        moe.limit,
        moe.n_group,
        moe.topk_group,
        moe.routed_scaling,
    )


def _linear(
    weight: Weight | None, bias: torch.Tensor | None, none: torch.Tensor
) -> list[torch.Tensor] | None:
    """(w0, w1, w2, bias) of a linear as `apply` takes it (all empty for None); None where
    `linear_dense` would refuse it (inputs not a multiple of 32: `linear` falls back to torch)."""
    if weight is None:
        return [none] * 4
    if isinstance(weight, QuantizedWeight):
        parts = [weight.qweight, weight.scales, none if weight.mins is None else weight.mins]
    elif weight.shape[1] % 32 == 0:
        parts = [weight, none, none]
    else:
        return None
    return [*parts, none if bias is None else bias]


def _layer(
    w: LayerWeights, dtype: torch.dtype, moe: MoeConfig | None
) -> tuple[list[torch.Tensor], float] | None:
    """A layer's tensors in csrc/decoder.cpp's `Slot` order (an empty tensor for what the layer
    lacks) and its row limit; None where a kernel there would refuse one (the op-by-op path
    falls back to PyTorch instead): a norm of another dtype, a dense linear whose inputs are
    not a multiple of 32, sinks that are not contiguous fp32 on the CPU, experts that
    csrc/moe.cpp refuses."""
    none = torch.empty(0, dtype=dtype)
    norms = (w.ln1, w.post1, w.ln2, w.post2, w.q_norm, w.k_norm)
    mla = None if w.mla is None else _latent(w.mla, none)
    if any(n is not None and n.dtype != dtype for n in norms) or (w.mla and mla is None):
        return None
    if (w.qkv_w is None and mla is None) or (
        w.moe is None and (w.gate_up_w is None or w.down_w is None)
    ):
        return None  # other attention (linear); no MLP
    flat = [none if n is None else n for n in norms]
    # the dense MLP's slots empty where experts replace it
    linears = ((w.qkv_w, w.qkv_b), (w.o_w, w.o_b), (w.gate_up_w, w.gate_up_b), (w.down_w, w.down_b))
    for weight, bias in linears:
        part = _linear(weight, bias, none)
        if part is None:
            return None
        flat += part
    sinks = w.attn.sinks
    if sinks is not None and (
        sinks.dtype != torch.float32 or sinks.device.type != "cpu" or not sinks.is_contiguous()
    ):
        return None
    flat.append(none if sinks is None else sinks)
    rows = min(kernel_rows(lw) for lw, _ in linears if lw is not None)
    latent = [none] * MLA_SLOTS
    if mla is not None:
        latent, rows = mla[0], min(rows, mla[1])
    if w.moe is None or moe is None:
        return [*flat, *[none] * MOE_SLOTS, *latent], rows
    experts = _experts(w.moe, moe.top_k, none)
    if experts is None:
        return None
    return [*flat, *experts[0], *latent], min(rows, experts[1])


def _latent(w: MlaWeights, none: torch.Tensor) -> tuple[list[torch.Tensor], float] | None:
    """A latent-attention layer's slots (csrc/mla_decode.cpp's MlaSlot) and their row limit;
    None where a kernel would refuse them (norms of another dtype, inputs not a multiple of
    32)."""
    norms = [n for n in (w.q_a_norm, w.kv_a_norm) if n is not None]
    if any(n.dtype != none.dtype for n in norms):
        return None
    weights = [lw for lw in (w.q_a_w, w.q_b_w, w.kv_a_w) if lw is not None]
    parts = [_linear(w.q_a_w, w.q_a_b, none), _linear(w.q_b_w, None, none)]
    parts.append(_linear(w.kv_a_w, w.kv_a_b, none))
    if any(p is None for p in parts):
        return None
    q_a, q_b, kv_a = (p for p in parts if p is not None)
    q_a_norm = none if w.q_a_norm is None else w.q_a_norm
    flat = [*q_a, q_a_norm, *q_b, *kv_a, w.kv_a_norm, w.w_uk, w.w_uv]
    return flat, min(kernel_rows(lw) for lw in weights)


def _experts(
    w: MoeWeights, top_k: int, none: torch.Tensor
) -> tuple[list[torch.Tensor], float] | None:
    """The mixture of experts' slots (router; the experts' gate/up and down; the shared
    expert's gate/up, down and gate) and their row limit; None where a kernel would refuse
    them."""
    e, shared = w.experts, w.shared
    if not _experts_taken(e, top_k, none.dtype):
        return None
    linears = [_linear(w.router_w, w.router_b, none)]
    if shared is None:
        linears += [[none] * 4] * 3
    else:
        linears += [_linear(shared.gate_up, None, none), _linear(shared.down, None, none)]
        linears.append(_linear(shared.gate, None, none))
    if any(p is None for p in linears):
        return None
    flat = [t for p in linears if p is not None for t in p]
    flat[4:4] = [*_stacked(e.w13, e.b13, none), *_stacked(e.w2, e.b2, none)]
    flat.append(none if w.score_bias is None else w.score_bias)
    weights = [w.router_w] + ([] if shared is None else [shared.gate_up, shared.down])
    rows = min(kernel_rows(lw) for lw in weights)
    limit = max_kernel_rows(e)
    return flat, rows if limit < 0 else min(rows, limit)


def _stacked(w: Weight, bias: torch.Tensor | None, none: torch.Tensor) -> list[torch.Tensor]:
    """(w0, w1, w2, bias) of stacked experts, as csrc/moe.cpp takes them."""
    if isinstance(w, QuantizedWeight):
        parts = [w.qweight, w.scales, none if w.mins is None else w.mins]
    else:
        parts = [w, none, none]
    return [*parts, none if bias is None else bias]


def _experts_taken(experts: Experts, top_k: int, dtype: torch.dtype) -> bool:
    """Whether csrc/moe.cpp takes these experts (their format and shapes): one token through
    experts 0..top_k-1."""
    w2 = experts.w2.qweight if isinstance(experts.w2, QuantizedWeight) else experts.w2
    x = torch.zeros(1, w2.shape[1], dtype=dtype)
    ids = torch.arange(top_k).view(1, top_k)
    return fused_experts_cpu(x, torch.full((1, top_k), 1.0 / top_k), ids, experts) is not None

"""The decoder's layers as csrc/decoder.cpp's `decode_layers` takes them: every layer's
tensors flattened in its `Slot` order, for the whole decode step in one C++ call."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedllm.layers.attention import cpu_kernels
from pagedllm.layers.quant import QuantizedWeight, kernel_rows

if TYPE_CHECKING:
    from pagedllm.model.decoder import CausalLM, LayerWeights


def flatten(model: CausalLM) -> tuple[list[torch.Tensor], float]:
    """The layers' weights flattened for `decode_layers`, and the most decodes it runs (the
    linear kernels' row limit); ([], 0) where it cannot run: tensor parallelism, not the CPU,
    no extension, attention or weights the kernels refuse."""
    cfg, norm = model.config, model.norm.weight
    module = cpu_kernels.kernel_module()
    if model.tp is not None or norm.device.type != "cpu" or module is None:
        return [], 0.0
    if not cpu_kernels.supports_shape(norm.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim):
        return [], 0.0
    flat: list[torch.Tensor] = []
    for w in model.layer_weights:
        layer = _layer(w, norm.dtype)
        if layer is None:  # the layers run op by op
            return [], 0.0
        flat += layer
    linears = (
        w
        for layer in model.layer_weights
        for w in (layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w)
        if w is not None
    )
    return flat, min(kernel_rows(w) for w in linears)


def _layer(w: LayerWeights, dtype: torch.dtype) -> list[torch.Tensor] | None:
    """A layer's tensors in csrc/decoder.cpp's `Slot` order (an empty tensor for what the layer
    lacks), its attention sinks last; None where a kernel there would refuse one (the op-by-op
    path falls back to PyTorch instead): a norm of another dtype, a dense linear whose inputs
    are not a multiple of 32, sinks that are not contiguous fp32 on the CPU."""
    none = torch.empty(0, dtype=dtype)
    norms = (w.ln1, w.post1, w.ln2, w.post2, w.q_norm, w.k_norm)
    if any(n is not None and n.dtype != dtype for n in norms):
        return None
    flat = [none if n is None else n for n in norms]
    for weight, bias in (
        (w.qkv_w, w.qkv_b),
        (w.o_w, w.o_b),
        (w.gate_up_w, w.gate_up_b),
        (w.down_w, w.down_b),
    ):
        if isinstance(weight, QuantizedWeight):
            flat += [weight.qweight, weight.scales, none if weight.mins is None else weight.mins]
        elif weight is not None and weight.shape[1] % 32 == 0:
            flat += [weight, none, none]
        else:
            return None
        flat.append(none if bias is None else bias)
    sinks = w.attn.sinks
    if sinks is None:
        return [*flat, none]
    if sinks.dtype != torch.float32 or sinks.device.type != "cpu" or not sinks.is_contiguous():
        return None
    return [*flat, sinks]

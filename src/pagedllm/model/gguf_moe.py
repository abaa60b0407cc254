"""The mixture-of-experts tensors of a GGUF file (model/gguf.py), as llama.cpp's converter
writes Qwen2-MoE's and Qwen3-MoE's: each layer's experts stacked in one 3-D tensor per
projection (`ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`, (E, out, in) once GGUF's
inner-first dims are reversed), the router `ffn_gate_inp`, the shared expert's
`ffn_gate_shexp` / `ffn_up_shexp` / `ffn_down_shexp` and its gate `ffn_gate_inp_shexp` (1-D).

A stacked tensor is decoded whole (its blocks run along each expert's rows) and handed on as
one shard per expert, in model/moe_layout.py's order: shard `2e + p` of `experts_gate_up` is
expert e's gate (p = 0) or up (p = 1), shard `e` of `experts_down` expert e's. The router and
the shared expert's gate stay dense (as at quantization at load): a quantized one is
dequantized. Only the MoE archs transformers reads from GGUF are read (`MOE_ARCHS`); the
others are refused before the file is opened."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pagedllm.config import ConfigError, ModelConfig
from pagedllm.layers.quant import QuantizedWeight

# HF architectures whose MoE GGUF files are read (transformers reads these, and no others)
MOE_ARCHS = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

LAYER_NAMES = {
    "ffn_gate_inp": ("mlp.router", None),
    "ffn_gate_exps": ("mlp.experts_gate_up", 0),
    "ffn_up_exps": ("mlp.experts_gate_up", 1),
    "ffn_down_exps": ("mlp.experts_down", None),
    "ffn_gate_shexp": ("mlp.shared_gate_up", 0),
    "ffn_up_shexp": ("mlp.shared_gate_up", 1),
    "ffn_down_shexp": ("mlp.shared_down", None),
    "ffn_gate_inp_shexp": ("mlp.shared_gate", None),
}
_DENSE = ("router", "shared_gate")
SPLIT = (*_DENSE, "experts_gate_up", "experts_down")  # the modules `split` hands on


def refuse_unread(cfg: ModelConfig) -> None:
    """A clear error for the experts and latent-attention models whose GGUF files we (and
    transformers) do not read."""
    if cfg.mla is None and (cfg.moe is None or cfg.architecture in MOE_ARCHS):
        return
    raise ConfigError(
        f"GGUF files of {cfg.architecture} (experts or latent attention) are not read: "
        f"mixture-of-experts GGUF is read for {', '.join(MOE_ARCHS)} only (as transformers "
        "reads it); load its safetensors, quantized at load with quantization 'int8' or 'int4'"
    )


def stacked_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D (E * out, in) a stacked (E, out, in) tensor is decoded as."""
    return (shape[0] * shape[1], shape[2]) if len(shape) == 3 else (shape[0], shape[1])


def split(
    ours: str, shard: int | None, tensor: torch.Tensor | QuantizedWeight, cfg: ModelConfig
) -> Iterator[tuple[str, int | None, torch.Tensor | QuantizedWeight]]:
    """(our name, shard, tensor): a stacked experts tensor as one shard per expert; a
    quantized router or shared-expert gate dequantized (the gate to its (1, H) weight)."""
    module = ours.split(".")[-2]
    if module in _DENSE:
        if isinstance(tensor, QuantizedWeight):
            tensor = tensor.dequantize()
        yield ours, shard, tensor.reshape(1, -1) if module == "shared_gate" else tensor
        return
    assert cfg.moe is not None
    experts = cfg.moe.num_experts
    if tensor.shape[0] % experts:
        raise ConfigError(f"{ours}: {tensor.shape[0]} rows are not {experts} experts' rows")
    rows = tensor.shape[0] // experts
    for e in range(experts):
        part = tensor.narrow(0, e * rows, rows)
        yield ours, e if shard is None else 2 * e + shard, part


def stack(weight: QuantizedWeight, shape: tuple[int, ...], name: str) -> QuantizedWeight:
    """The experts' shards, concatenated along rows, as one weight with the expert dim leading
    each of its tensors (layers/moe.py's `quantize_experts` layout); `shape`: our (E, N, K)."""
    experts, n, k = shape
    if weight.shape != (experts * n, k):
        raise ConfigError(
            f"GGUF tensors for {name!r} have shape {weight.shape}, expected {(experts * n, k)}"
        )
    mins = None if weight.mins is None else weight.mins.reshape(experts, n, -1)
    return QuantizedWeight(
        weight.bits,
        weight.qweight.reshape(experts, n, -1),
        weight.scales.reshape(experts, n, -1),
        mins,
    )

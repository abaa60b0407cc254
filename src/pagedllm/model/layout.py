"""From a HF checkpoint's names and layout to ours (model/decoder.py), per family feature: which
parameter a tensor fills, and what the loaded weights are turned into before use."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch

from pagedllm.config import ModelConfig
from pagedllm.layers.quant import QuantizedWeight
from pagedllm.model import hybrid_layout, kv_scales, moe_layout
from pagedllm.model.rope import interleave_rows

if TYPE_CHECKING:
    from pagedllm.model.decoder import Attention, CausalLM
    from pagedllm.model.mla import MlaAttention

# HF name -> (our name, shard index within a fused tensor or None)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")
_NORM = re.compile(r"^model\.layers\.(\d+)\.(\w+layernorm)\.weight$")
# fused in some checkpoints (Phi-3): split into their shards on load
FUSED_IN_CHECKPOINT = ("qkv_proj", "gate_up_proj")


def target(name: str, cfg: ModelConfig) -> tuple[str, int | None] | None:
    """Map a HF tensor name to our parameter name (and fused shard), None to skip it."""
    if name.endswith("rotary_emb.inv_freq") or kv_scales.kind(name) is not None:
        return None  # (an fp8 cache's scales: read by the loader, kv_scales.py)
    if cfg.hybrid is not None:  # Qwen3.5: a vision-language checkpoint's text, linear layers
        text = hybrid_layout.text_name(name)
        if text is None:
            return None
        if (linear := hybrid_layout.target(text)) is not None:
            return linear
        name = text
    if cfg.moe is not None and (moe := moe_layout.target(name)) is not None:
        return moe
    m = _LAYER.match(name)
    if m:
        layer, block, proj, kind = m.groups()
        ours, shard = _FUSED.get(proj, (proj, None))
        if cfg.mla is not None and block == "self_attn":  # MLA's q_proj stays apart (mla.py)
            ours, shard = proj, None
        return f"layers.{layer}.{block}.{ours}.{kind}", shard
    m = _NORM.match(name)
    if m and cfg.norms == "pre" and m.group(2) == "post_attention_layernorm":
        # Llama's norm before the MLP; ours are named as Gemma's (decoder.NORMS)
        return f"layers.{m.group(1)}.pre_feedforward_layernorm.weight", None
    if name.startswith("model."):
        return name.removeprefix("model."), None
    return name, None


def fused_in_checkpoint(name: str, cfg: ModelConfig | None = None) -> bool:
    """A q/k/v or gate/up projection stored fused (Phi-3), or every expert's projection in one
    tensor, or (`cfg` a hybrid's) what hybrid_layout reads whole."""
    if cfg is not None and cfg.hybrid is not None and hybrid_layout.read_whole(name):
        return True
    m = _LAYER.match(name)
    return (m is not None and m.group(3) in FUSED_IN_CHECKPOINT) or moe_layout.stacked(name)


def shard_sizes(cfg: ModelConfig) -> dict[str, list[int]]:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hybrid = {} if cfg.hybrid is None else hybrid_layout.shard_sizes(cfg.hybrid)
    return {
        **hybrid,
        "qkv_proj": [q, kv, kv] + ([q] if cfg.hybrid else []),  # gated attention's gates
        "gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
        **moe_layout.shard_sizes(cfg, cfg.hidden_size),
    }


def unfuse(
    name: str, tensor: torch.Tensor, cfg: ModelConfig
) -> Iterator[tuple[str, int | None, torch.Tensor]]:
    """(our name, shard, tensor) of a checkpoint tensor: a fused projection (`cfg`: the whole
    model's sizes) as its shards, anything else as it is."""
    t = target(name, cfg)
    if t is None:
        return
    ours, shard = t
    if cfg.hybrid is not None and (parts := hybrid_layout.split(ours, shard, tensor, cfg)):
        yield from parts
        return
    if not fused_in_checkpoint(name):
        yield ours, shard, tensor
        return
    if moe_layout.stacked(name):
        yield from moe_layout.unfuse(ours, tensor, cfg)
        return
    sizes = shard_sizes(cfg)[ours.split(".")[-2]]
    if tensor.shape[0] != sum(sizes):
        yield ours, None, tensor  # the shape check names it
        return
    for i, part in enumerate(tensor.split(sizes, dim=0)):
        yield ours, i, part


@torch.no_grad()
def adapt(model: CausalLM, cfg: ModelConfig, from_gguf: bool) -> None:
    """The loaded weights in our layout: q/k rows (and q/k norm weights) in the interleaved
    rotary order, (1 + w) norms stored as 1 + w, the residual multiplier folded into the
    projections that feed the stream. From a GGUF file the first two are done already:
    by llama.cpp's converter, or by model/gguf.py for what the converter leaves half-split."""
    if not from_gguf:
        if cfg.mla is None:
            _interleave_rotary_rows(model, cfg)
        elif not cfg.mla.rope_interleave:  # latent attention's rotated rows (model/mla.py)
            _interleave_mla_rope_rows(model, cfg)
        if cfg.unit_offset_norm:
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(1.0)
    if cfg.residual_scale != 1.0:
        for i in range(cfg.num_layers):
            for proj in ("self_attn.o_proj", "mlp.down_proj"):
                _scale(model, f"layers.{i}.{proj}", cfg.residual_scale)


def _scale(model: CausalLM, module: str, factor: float) -> None:
    name = f"{module}.weight"
    weight = model.quantized.get(name)
    if isinstance(weight, QuantizedWeight):
        mins = None if weight.mins is None else weight.mins * factor
        model.set_quantized(
            name, QuantizedWeight(weight.bits, weight.qweight, weight.scales * factor, mins)
        )
    else:
        model.get_parameter(name).mul_(factor)
    bias = model.get_submodule(module).bias
    if isinstance(bias, torch.Tensor):
        bias.mul_(factor)


def _interleave_rotary_rows(model: CausalLM, cfg: ModelConfig) -> None:
    h, kvh, hd, rot = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim
    q, k = h * hd, kvh * hd
    for layer in model.decoder_layers():
        attn = cast("Attention", layer.self_attn)
        if not hasattr(attn, "qkv_proj"):  # a linear-attention layer (model/gdn_block.py)
            continue
        for t in (attn.qkv_proj.weight, attn.qkv_proj.bias):
            if t is None:
                continue
            t[:q] = interleave_rows(t[:q], h, hd, rot)
            t[q : q + k] = interleave_rows(t[q : q + k], kvh, hd, rot)
        if cfg.qk_norm is not None:  # a norm weight per row of q / k, permuted with them
            per_head = cfg.qk_norm == "head"
            for norm, heads in ((attn.q_norm.weight, h), (attn.k_norm.weight, kvh)):
                norm.copy_(interleave_rows(norm, 1 if per_head else heads, hd, rot))


def _interleave_mla_rope_rows(model: CausalLM, cfg: ModelConfig) -> None:
    """Latent attention's rotated rows, half-split in the checkpoint (rope_interleave false):
    the last qk_rope_head_dim rows of each query head, and of kv_a_proj_with_mqa (the shared
    key after the latent), to the interleaved order."""
    mla, h = cfg.mla, cfg.num_heads
    assert mla is not None
    nope, rope = mla.qk_nope_head_dim, mla.qk_rope_head_dim
    for layer in model.decoder_layers():
        attn = cast("MlaAttention", layer.self_attn)
        q = attn.q_proj if mla.q_lora_rank is None else attn.q_b_proj
        heads = q.weight.view(h, mla.qk_head_dim, -1)
        rows = heads[:, nope:].reshape(h * rope, -1)
        heads[:, nope:] = interleave_rows(rows, h, rope).view(h, rope, -1)
        kv_a = attn.kv_a_proj_with_mqa
        for t in (kv_a.weight, kv_a.bias):
            if t is not None:
                t[mla.kv_lora_rank :] = interleave_rows(t[mla.kv_lora_rank :], 1, rope)

"""The per-layer weights a step reads (`LayerWeights`) and what a step's layers share
(`ForwardContext`): model/decoder.py builds and passes them, model/decoder_kernel.py flattens
them for the one-call C++ decode."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from pagedllm.layers.attention import AttentionBackend
from pagedllm.layers.attention.base import AttnLayer
from pagedllm.layers.quant import Weight
from pagedllm.model.gdn_block import GdnStep, GdnWeights
from pagedllm.model.mla import MlaWeights
from pagedllm.model.moe_block import MoeWeights

if TYPE_CHECKING:
    from pagedllm.lora.ops import LoraStep


class LayerWeights(NamedTuple):
    ln1: torch.Tensor | None  # before attention
    qkv_w: Weight | None  # None: latent attention (mla)
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_w: Weight
    o_b: torch.Tensor | None
    post1: torch.Tensor | None  # after attention
    ln2: torch.Tensor | None  # before the MLP
    gate_up_w: Weight | None  # the dense MLP's (None: experts instead)
    gate_up_b: torch.Tensor | None
    down_w: Weight | None
    down_b: torch.Tensor | None
    post2: torch.Tensor | None  # after the MLP
    attn: AttnLayer  # scale, window, soft-cap, sinks
    rope: int | None  # index of its rotation in ForwardContext.rotary; None: NoPE
    moe: MoeWeights | None = None  # a mixture of experts in place of the MLP
    mla: MlaWeights | None = None  # multi-head latent attention in place of q/k/v
    gdn: GdnWeights | None = None  # Gated-DeltaNet linear attention in place of attention


class ForwardContext(NamedTuple):
    """Everything a step's layers share: the rotation of each token by each of the model's
    ropes (complex, (N, 1, head_dim/2) each), the KV caches, the attention backend and its
    per-step metadata; the step's LoRA deltas (lora/ops.py; None: no adapter in the step)."""

    rotary: tuple[torch.Tensor, ...]
    kv_caches: list[torch.Tensor]
    backend: AttentionBackend
    attn_metadata: Any
    lora: LoraStep | None = None
    gdn: GdnStep | None = None  # a hybrid model's linear-attention states (model/gdn_block.py)

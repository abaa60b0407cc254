"""A hybrid checkpoint's names and layout to ours (Qwen3.5, model/gdn_block.py): the
Gated-DeltaNet layers' tensors, gated attention's q projection split into q and its output
gates, and a vision-language checkpoint's text weights (`model.language_model.*`; the vision
tower and the multi-token-prediction head are not loaded)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedllm.config import ModelConfig

_LINEAR = re.compile(r"^model\.layers\.(\d+)\.linear_attn\.(\w+(?:\.\w+)?)$")
# HF name in a linear layer -> (ours under `self_attn`, shard of the fused in_proj or None)
_NAMES = {
    "in_proj_qkv.weight": ("in_proj.weight", 0),
    "in_proj_z.weight": ("in_proj.weight", 1),
    "in_proj_b.weight": ("in_proj.weight", 2),
    "in_proj_a.weight": ("in_proj.weight", 3),
    "conv1d.weight": ("conv1d.weight", None),
    "dt_bias": ("dt_bias", None),
    "A_log": ("A_log", None),
    "norm.weight": ("norm_weight", None),
    "out_proj.weight": ("o_proj.weight", None),
}
_SKIPPED = ("model.visual.", "mtp.", "model.language_model.visual.")
# the shard of our fused qkv_proj that gated attention's output gates fill (after q, k, v)
GATE_SHARD = 3


def text_name(name: str) -> str | None:
    """The text model's name of a checkpoint tensor; None for what is not loaded."""
    if name.startswith(_SKIPPED):
        return None
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name


def target(name: str) -> tuple[str, int | None] | None:
    """A linear layer's tensor: our parameter name and fused shard; None for other names."""
    m = _LINEAR.match(name)
    if m is None or m.group(2) not in _NAMES:
        return None
    ours, shard = _NAMES[m.group(2)]
    return f"layers.{m.group(1)}.self_attn.{ours}", shard


def split_gated_q(
    ours: str, tensor: torch.Tensor, cfg: ModelConfig
) -> Iterator[tuple[str, int | None, torch.Tensor]]:
    """Gated attention's q_proj (heads x [q | gate] rows): q as qkv_proj's shard 0, the gates
    as its shard GATE_SHARD."""
    h, hd = cfg.num_heads, cfg.head_dim
    if tensor.shape[0] != 2 * h * hd:
        yield ours, 0, tensor  # the shape check names it
        return
    heads = tensor.reshape(h, 2, hd, *tensor.shape[1:])
    yield ours, 0, heads[:, 0].reshape(h * hd, *tensor.shape[1:]).contiguous()
    yield ours, GATE_SHARD, heads[:, 1].reshape(h * hd, *tensor.shape[1:]).contiguous()

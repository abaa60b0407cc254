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
    from pagedllm.hybrid_config import HybridConfig

_LINEAR = re.compile(r"^model\.layers\.(\d+)\.linear_attn\.(\w+(?:\.\w+)?)$")
_GATED_Q = re.compile(r"^model\.layers\.\d+\.self_attn\.q_proj\.weight$")
# HF name in a linear layer -> (ours under `self_attn`, shard or None). in_proj is fused from
# six shards: q, k, v (the conv's channels: in_proj_qkv, split by `split`), z, b, a; the conv's
# weight from three: q, k, v. Each shard splits by heads over tensor-parallel ranks.
_NAMES = {
    "in_proj_qkv.weight": ("in_proj.weight", 0),
    "in_proj_z.weight": ("in_proj.weight", 3),
    "in_proj_b.weight": ("in_proj.weight", 4),
    "in_proj_a.weight": ("in_proj.weight", 5),
    "conv1d.weight": ("conv1d.weight", 0),
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


def read_whole(name: str) -> bool:
    """Tensors the loader reads whole and splits into shards (then each shard's part of a
    tensor-parallel rank): gated q and the linear layers' (all small)."""
    text = text_name(name)
    return text is not None and (_LINEAR.match(text) or _GATED_Q.match(text)) is not None


def split(
    ours: str, shard: int | None, tensor: torch.Tensor, cfg: ModelConfig
) -> Iterator[tuple[str, int | None, torch.Tensor]] | None:
    """The shards of a tensor that fills several (None: it fills one, as it is)."""
    if ours.endswith("qkv_proj.weight") and shard == 0:
        return _split_gated_q(ours, tensor, cfg.head_dim)
    if ours.endswith(("in_proj.weight", "conv1d.weight")) and shard == 0 and cfg.hybrid:
        s = cfg.hybrid.shape
        sizes = [s.key_heads * s.key_dim] * 2 + [s.value_heads * s.value_dim]
        if tensor.shape[0] == sum(sizes):  # else the shape check names it
            return ((ours, i, part) for i, part in enumerate(tensor.split(sizes)))
    return None


def _split_gated_q(
    ours: str, tensor: torch.Tensor, hd: int
) -> Iterator[tuple[str, int | None, torch.Tensor]]:
    """Gated attention's q_proj (heads x [q | gate] rows): q as qkv_proj's shard 0, the gates
    as its shard GATE_SHARD."""
    h, rest = tensor.shape[0] // (2 * hd), tensor.shape[1:]
    if tensor.shape[0] != 2 * h * hd:
        yield ours, 0, tensor  # the shape check names it
        return
    heads = tensor.reshape(h, 2, hd, *rest)
    yield ours, 0, heads[:, 0].reshape(h * hd, *rest).contiguous()
    yield ours, GATE_SHARD, heads[:, 1].reshape(h * hd, *rest).contiguous()


def shard_sizes(hybrid: HybridConfig) -> dict[str, list[int]]:
    """The fused parameters' shards (a rank's sizes where `hybrid` is its local config)."""
    s = hybrid.shape
    qk, v = s.key_heads * s.key_dim, s.value_heads * s.value_dim
    return {"in_proj": [qk, qk, v, v, s.value_heads, s.value_heads], "conv1d": [qk, qk, v]}

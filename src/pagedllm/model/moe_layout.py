"""The experts' tensors of a HF checkpoint -> ours (model/moe_block.py): one tensor per
expert and projection (Mixtral's `block_sparse_moe.experts.E.w1/w3/w2`, Qwen-MoE's
`mlp.experts.E.gate_proj/up_proj/down_proj`, as transformers saves them and the Hub holds
them), or every expert stacked in one tensor (transformers' in-memory layout, or gpt-oss's,
whose gate and up columns interleave), which is read whole and split per expert.

Our stacked parameters are filled per expert: shard `2e + p` of `experts_gate_up` is expert
e's gate (p = 0) or up (p = 1) rows; shard `e` of `experts_down` is expert e's (H, I)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from pagedllm.config import ModelConfig

_PER_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.(weight|bias)$"
)
_STACKED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(?:gate|router)\.(\w+)$")
_SHARED = re.compile(r"^model\.layers\.(\d+)\.mlp\.shared_experts?\.(\w+)_proj\.weight$")
_SHARED_GATE = re.compile(r"^model\.layers\.(\d+)\.mlp\.shared_expert_gate\.weight$")
# a projection -> (our module, its part within an expert's gate_up: None for down)
_PROJ = {
    "w1": ("experts_gate_up", 0),
    "gate_proj": ("experts_gate_up", 0),
    "w3": ("experts_gate_up", 1),
    "up_proj": ("experts_gate_up", 1),
    "w2": ("experts_down", None),
    "down_proj": ("experts_down", None),
}
_SHARED_PROJ = {
    "gate": ("shared_gate_up", 0),
    "up": ("shared_gate_up", 1),
    "down": ("shared_down", None),
}
EXPERT_MODULES = ("experts_gate_up", "experts_down")


def target(name: str) -> tuple[str, int | None] | None:
    """Our parameter (and shard) for an expert, router or shared-expert tensor; None for any
    other tensor."""
    if m := _PER_EXPERT.match(name):
        layer, expert, proj, kind = m.groups()
        if proj not in _PROJ:
            return None
        module, part = _PROJ[proj]
        shard = int(expert) if part is None else 2 * int(expert) + part
        return f"layers.{layer}.mlp.{module}.{kind}", shard
    if m := _STACKED.match(name):
        layer, proj, bias = m.groups()
        module = "experts_gate_up" if proj == "gate_up_proj" else "experts_down"
        return f"layers.{layer}.mlp.{module}.{'bias' if bias else 'weight'}", None
    if m := _ROUTER.match(name):
        if m.group(2) == "e_score_correction_bias":  # DeepSeek's: for choosing only
            return f"layers.{m.group(1)}.mlp.score_bias", None
        return f"layers.{m.group(1)}.mlp.router.{m.group(2)}", None
    if m := _SHARED.match(name):
        module, part = _SHARED_PROJ[m.group(2)]
        return f"layers.{m.group(1)}.mlp.{module}.weight", part
    if m := _SHARED_GATE.match(name):
        return f"layers.{m.group(1)}.mlp.shared_gate.weight", None
    return None


def stacked(name: str) -> bool:
    """Every expert's projection in one tensor (read whole, split by `unfuse`)."""
    return _STACKED.match(name) is not None


def unfuse(
    ours: str, tensor: torch.Tensor, cfg: ModelConfig
) -> Iterator[tuple[str, int, torch.Tensor]]:
    """A stacked tensor as (our name, shard, one expert's part) for every expert."""
    assert cfg.moe is not None
    gate_up, weight = ours.split(".")[-2] == "experts_gate_up", ours.endswith(".weight")
    if cfg.moe.oai_layout and weight:  # x @ W: (E, in, out) -> our (E, out, in)
        tensor = tensor.transpose(1, 2)
    for e, t in enumerate(tensor):
        if not gate_up:
            yield ours, e, t
            continue
        if cfg.moe.oai_layout:  # gate and up interleave: even rows gate, odd rows up
            gate, up = t[0::2], t[1::2]
        else:
            gate, up = t.chunk(2, dim=0)
        yield ours, 2 * e, gate
        yield ours, 2 * e + 1, up


def shard_sizes(cfg: ModelConfig, hidden: int) -> dict[str, list[int]]:
    """The shards of each of our MoE modules along its (flattened) first dims."""
    if cfg.moe is None:
        return {}
    e, i, s = cfg.moe.num_experts, cfg.moe.intermediate_size, cfg.moe.shared_intermediate_size
    sizes = {"experts_gate_up": [i, i] * e, "experts_down": [hidden] * e}
    if s:
        sizes["shared_gate_up"] = [s, s]
    return sizes

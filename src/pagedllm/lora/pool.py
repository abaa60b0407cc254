"""The shapes and bytes of the device pool of LoRA adapters (lora/slots.py allocates it), so the
KV pool is sized after it (kv_budget.py's `reserved_bytes`).

Per layer and adapted module (qkv, o, gate/up, down) the pool holds every slot's A (parts * R,
in) and B (out, parts * R), R = max_lora_rank, `parts` the projections fused in the module: in
all, layers x max_loras x parts x R x (in + out) values of the model's dtype. Each rank of a
tensor-parallel engine holds its shard (its heads' and its intermediate columns' rows).
"""

from __future__ import annotations

import logging
import math

import torch

from pagedllm.lora.request import LoRAConfig
from pagedllm.model_config import ModelConfig

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]


def module_dims(local: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """module -> (parts, out, in) of a rank's model (`local`: its sizes)."""
    q, kv = local.num_heads * local.head_dim, local.num_kv_heads * local.head_dim
    d, i = local.hidden_size, local.intermediate_size
    return {"qkv": (3, q + 2 * kv, d), "o": (1, d, q), "gate_up": (2, 2 * i, d), "down": (1, d, i)}


def pool_shapes(local: ModelConfig, lora: LoRAConfig) -> dict[str, tuple[Shape, Shape]]:
    """module -> every layer's A (layers, slots, parts * R, in) and B (layers, slots, out,
    parts * R)."""
    s, r, layers = lora.max_loras, lora.max_lora_rank, local.num_layers
    return {
        m: ((layers, s, parts * r, inp), (layers, s, out, parts * r))
        for m, (parts, out, inp) in module_dims(local).items()
    }


def pool_bytes(cfg: ModelConfig, lora: LoRAConfig, dtype: torch.dtype, world: int = 1) -> int:
    """The pool's bytes on the rank that holds the most of it (every rank where `world` > 1)."""
    locals_ = [cfg]
    if world > 1:
        from pagedllm.distributed.shard import ShardPlan

        locals_ = [ShardPlan.create(cfg, rank, world).local_config(cfg) for rank in range(world)]
    values = max(
        sum(math.prod(a) + math.prod(b) for a, b in pool_shapes(c, lora).values()) for c in locals_
    )
    return values * dtype.itemsize


def reserve(cfg: ModelConfig, lora: LoRAConfig | None, dtype: torch.dtype, world: int) -> int:
    """Bytes set aside from the GPU's KV budget for the pool (0: LoRA off), logged."""
    if lora is None:
        return 0
    size = pool_bytes(cfg, lora, dtype, world)
    logger.info(
        "LoRA slot pool: %d slots of rank %d, %.1f MiB per rank, set aside from the KV budget",
        lora.max_loras,
        lora.max_lora_rank,
        size / (1 << 20),
    )
    return size

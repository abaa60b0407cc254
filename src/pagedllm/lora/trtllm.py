"""TensorRT-LLM's LoRA tensors (`lora_weights`, `lora_config`) read into our adapter.

TensorRT-LLM's backend takes an adapter as rows (its docs/source/advanced/lora.md, written by
its examples/hf_lora_convert.py from a PEFT folder): `lora_config` [N, 3] int32, each row
`[module_id, layer_idx, adapter_size r]`; `lora_weights` [N, W], each row the module's
in-weights A (r, in) flattened, then its out-weights B (out, r) flattened, already scaled
(lora_alpha / r, or / sqrt(r) with rsLoRA), then padding up to W. Module ids (its
LoraManager.LORA_MODULE_IDS) and the HF projections its converter maps to them: 0 attn_qkv
(q, k and v stacked in B's rows, one A), 1 attn_q, 2 attn_k, 3 attn_v, 4 attn_dense
(o_proj), 5 mlp_h_to_4h (gate_proj), 6 mlp_4h_to_h (down_proj), 7 mlp_gate (up_proj).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.lora.adapter import LoraAdapter, LoRAError, expected_shapes, our_rows
from pagedllm.lora.request import LoRARequest
from pagedllm.model_config import ModelConfig

# module id -> the HF projections it stands for (attn_qkv: all three, B's rows in order)
MODULE_IDS: dict[int, tuple[str, ...]] = {
    0: ("q_proj", "k_proj", "v_proj"),
    1: ("q_proj",),
    2: ("k_proj",),
    3: ("v_proj",),
    4: ("o_proj",),
    5: ("gate_proj",),
    6: ("down_proj",),
    7: ("up_proj",),
}
MODULE_NAMES = {
    0: "attn_qkv",
    1: "attn_q",
    2: "attn_k",
    3: "attn_v",
    4: "attn_dense",
    5: "mlp_h_to_4h",
    6: "mlp_4h_to_h",
    7: "mlp_gate",
}


def adapter_from_rows(
    weights: np.ndarray,
    config: np.ndarray,
    request: LoRARequest,
    cfg: ModelConfig,
    max_rank: int,
) -> LoraAdapter:
    """The adapter the rows describe, checked against the base model `cfg` (full sizes);
    LoRAError naming the row and what is wrong with it."""
    name = request.lora_name
    if config.ndim != 2 or config.shape[1] != 3:
        raise LoRAError(f"{name}: lora_config must be [N, 3], got {list(config.shape)}")
    if weights.ndim != 2 or weights.shape[0] != config.shape[0]:
        raise LoRAError(
            f"{name}: lora_weights must be [N, W] with N = lora_config's {config.shape[0]} "
            f"rows, got {list(weights.shape)}"
        )
    if not np.issubdtype(config.dtype, np.integer):
        raise LoRAError(f"{name}: lora_config must hold integers, got {config.dtype}")
    if not np.issubdtype(weights.dtype, np.floating):
        raise LoRAError(f"{name}: lora_weights must hold floats, got {weights.dtype}")
    if config.shape[0] == 0:
        raise LoRAError(f"{name}: lora_config has no rows")
    shapes = expected_shapes(cfg)
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for k, (module, layer, rank) in enumerate(config.tolist()):
        where = f"{name}: lora_config row {k} {[module, layer, rank]}"
        projs = MODULE_IDS.get(module)
        if projs is None:
            known = ", ".join(f"{i} {n}" for i, n in MODULE_NAMES.items())
            raise LoRAError(f"{where}: module id {module} is not supported (supported: {known})")
        if not 0 <= layer < cfg.num_layers:
            raise LoRAError(f"{where}: layer {layer} is not one of the model's {cfg.num_layers}")
        if not 1 <= rank <= max_rank:
            raise LoRAError(f"{where}: adapter size {rank} is not in [1, max_lora_rank {max_rank}]")
        moe = cfg.layer_moe and cfg.layer_moe[layer]
        if moe and module in (5, 6, 7):
            raise LoRAError(f"{where}: layer {layer}'s MLP is a mixture of experts")
        inp = shapes[projs[0]][1]
        outs = [shapes[p][0] for p in projs]
        size = rank * (inp + sum(outs))
        if size > weights.shape[1]:
            raise LoRAError(
                f"{where}: needs {size} weights ({rank} x {inp} in, {sum(outs)} x {rank} out), "
                f"lora_weights rows hold {weights.shape[1]}"
            )
        row = torch.from_numpy(np.ascontiguousarray(weights[k, :size], dtype=np.float32))
        if not torch.isfinite(row).all():
            raise LoRAError(f"{where}: lora_weights row {k} is not finite")
        a, b = row[: rank * inp].view(rank, inp), row[rank * inp :].view(sum(outs), rank)
        for proj, b_part in zip(projs, b.split(outs), strict=True):
            if (layer, proj) in out:
                raise LoRAError(f"{where}: {proj} of layer {layer} is given twice")
            out[layer, proj] = (a.clone(), our_rows(b_part, proj, cfg).contiguous())
    return LoraAdapter(request, max(a.shape[0] for a, _ in out.values()), out)

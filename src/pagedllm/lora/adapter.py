"""A PEFT LoRA adapter folder read, checked against the base model and put in our layout.

PEFT saves `adapter_config.json` (r, lora_alpha, use_rslora, target_modules, ...) and
`adapter_model.safetensors` with, per adapted projection,
`base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight` (r, in) and
`...lora_B.weight` (out, r); the projection's output gains `scale * B @ A @ x`, where
scale = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)). Here the scale is folded into B, and B
gets the same row changes as its base weight (model/layout.py): q/k rows in the interleaved
rotary order, o/down scaled by the residual multiplier.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pagedllm.lora.request import LoRARequest
from pagedllm.model.rope import interleave_rows
from pagedllm.model_config import ModelConfig

# HF projection -> (our fused module, its part in it)
PROJECTIONS = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
_TENSOR = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class LoRAError(ValueError):
    """An adapter that cannot be served on this engine (the message names it and why)."""


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter's weights in fp32 on the host, full (unsharded) HF shapes, scale folded in
    B: (layer, HF projection) -> (A (r, in), B (out, r))."""

    request: LoRARequest
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def modules(self) -> set[str]:
        """Our modules it adapts (qkv, o, gate_up, down)."""
        return {PROJECTIONS[proj][0] for _, proj in self.weights}


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each adaptable HF projection."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    d, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (q, d),
        "k_proj": (kv, d),
        "v_proj": (kv, d),
        "o_proj": (d, q),
        "gate_proj": (i, d),
        "up_proj": (i, d),
        "down_proj": (d, i),
    }


def load_adapter(request: LoRARequest, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check `request.lora_path` against the base model `cfg` (full sizes)."""
    name = request.lora_name
    folder = Path(request.lora_path)
    config = _read_config(folder, name)
    alpha = float(config.get("lora_alpha", config.get("r", 8)))
    rslora = bool(config.get("use_rslora", False))
    _check_targets(config, name)
    raw = _read_tensors(folder / WEIGHTS_FILE, name)
    shapes = expected_shapes(cfg)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, proj), pair in sorted(raw.items()):
        if proj not in shapes:
            raise LoRAError(
                f"adapter {name!r} targets {proj!r}, which the model lacks (adaptable: "
                f"{', '.join(shapes)})"
            )
        if layer >= cfg.num_layers:
            raise LoRAError(
                f"adapter {name!r} has weights for layer {layer}; the model has {cfg.num_layers}"
            )
        if proj in ("gate_proj", "up_proj", "down_proj") and cfg.layer_moe and cfg.layer_moe[layer]:
            raise LoRAError(
                f"adapter {name!r} targets {proj!r} of layer {layer}: a mixture "
                "of experts there, which adapters cannot target"
            )
        if len(pair) != 2:
            raise LoRAError(f"adapter {name!r}: {proj} of layer {layer} lacks lora_A or lora_B")
        a, b = pair["A"].float(), pair["B"].float()
        rank = a.shape[0]
        out, inp = shapes[proj]
        if a.shape != (rank, inp) or b.shape != (out, rank):
            raise LoRAError(
                f"adapter {name!r}: {proj} of layer {layer} has lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)}; the model needs ({rank}, {inp}) and ({out}, {rank})"
            )
        if rank > max_rank:
            raise LoRAError(f"adapter {name!r} has rank {rank}, above max_lora_rank {max_rank}")
        scale = alpha / (math.sqrt(rank) if rslora else rank)
        weights[layer, proj] = (a.contiguous(), our_rows(b * scale, proj, cfg).contiguous())
    if not weights:
        raise LoRAError(f"adapter {name!r} has no LoRA weights in {WEIGHTS_FILE}")
    rank = max(a.shape[0] for a, _ in weights.values())
    return LoraAdapter(request, rank, weights)


def our_rows(b: torch.Tensor, proj: str, cfg: ModelConfig) -> torch.Tensor:
    """B's rows changed as the base weight's are (model/layout.py `adapt`)."""
    if proj == "q_proj":
        return interleave_rows(b, cfg.num_heads, cfg.head_dim, cfg.rotary_dim)
    if proj == "k_proj":
        return interleave_rows(b, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim)
    if proj in ("o_proj", "down_proj") and cfg.residual_scale != 1.0:
        return b * cfg.residual_scale
    return b


def _read_config(folder: Path, name: str) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoRAError(f"adapter {name!r}: no {CONFIG_FILE} in {str(folder)!r}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LoRAError(f"adapter {name!r}: {path} is not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise LoRAError(f"adapter {name!r}: {path} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"adapter {name!r} is a {config['peft_type']} adapter, not LORA")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
    }
    if bad := [k for k, v in unsupported.items() if v]:
        raise LoRAError(f"adapter {name!r}: {', '.join(bad)} not supported")
    return config


def _check_targets(config: dict, name: str) -> None:
    """A target_modules list naming a module the model lacks is refused (a regex string is
    checked through the tensors it produced)."""
    targets = config.get("target_modules")
    if isinstance(targets, list):
        missing = [t for t in targets if t.split(".")[-1] not in PROJECTIONS]
        if missing:
            raise LoRAError(
                f"adapter {name!r} targets {', '.join(map(repr, missing))}, which the model "
                f"lacks (adaptable: {', '.join(PROJECTIONS)})"
            )


def _read_tensors(path: Path, name: str) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    if not path.is_file():
        raise LoRAError(f"adapter {name!r}: no {WEIGHTS_FILE} in {str(path.parent)!r}")
    out: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                m = _TENSOR.match(key)
                if m is None:
                    raise LoRAError(
                        f"adapter {name!r}: tensor {key!r} is not a LoRA weight of a "
                        f"decoder layer's projection"
                    )
                layer, _, proj, ab = m.groups()
                out.setdefault((int(layer), proj), {})[ab] = f.get_tensor(key)
    except (SafetensorError, OSError) as e:
        raise LoRAError(f"adapter {name!r}: {path} is not a valid safetensors file ({e})") from e
    return out

"""Load a HuggingFace checkpoint directory (safetensors only, never pickle) into our modules."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pagedllm.config import ConfigError, ModelConfig
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.rope import interleave_rows

# HF name -> (our name, shard index within a fused tensor or None)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ConfigError(f"{index} is not a valid safetensors index: {e}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"no *.safetensors weights in {str(model_dir)!r} (pickled .bin checkpoints are "
            "never loaded: convert them to safetensors)"
        )
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise ConfigError(f"weight files missing from {str(model_dir)!r}: {missing}")
    return files


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ConfigError(f"cannot read weights from {path}: {e}") from e


def _target(name: str) -> tuple[str, int | None] | None:
    """Map a HF tensor name to our parameter name (and fused shard), None to skip it."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    m = _LAYER.match(name)
    if m:
        layer, block, proj, kind = m.groups()
        ours, shard = _FUSED.get(proj, (proj, None))
        return f"layers.{layer}.{block}.{ours}.{kind}", shard
    if name.startswith("model."):
        return name.removeprefix("model."), None
    return name, None


def load_model(
    model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: str
) -> LlamaForCausalLM:
    """Build the model on `device` in `dtype` and fill every parameter from the checkpoint."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    shard_sizes = _shard_sizes(cfg)
    loaded: set[tuple[str, int | None]] = set()
    for hf_name, tensor in iter_checkpoint(weight_files(Path(model_dir))):
        target = _target(hf_name)
        if target is None or (target[0] == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        ours, shard = target
        if ours not in params:
            raise ConfigError(f"unexpected tensor {hf_name!r} in the checkpoint")
        dest = params[ours].data
        if shard is not None:
            sizes = shard_sizes[ours.split(".")[-2]]
            dest = dest.split(sizes, dim=0)[shard]
        if dest.shape != tensor.shape:
            raise ConfigError(
                f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        loaded.add((ours, shard))
    _check_complete(params, shard_sizes, loaded, cfg)
    _interleave_rotary_rows(model, cfg)
    model.finalize_weights()
    return model.eval()


@torch.no_grad()
def _interleave_rotary_rows(model: LlamaForCausalLM, cfg: ModelConfig) -> None:
    q = cfg.num_heads * cfg.head_dim
    k = cfg.num_kv_heads * cfg.head_dim
    for layer in model.decoder_layers():
        proj = layer.self_attn.qkv_proj
        for t in (proj.weight, proj.bias):
            if t is None:
                continue
            t[:q] = interleave_rows(t[:q], cfg.num_heads, cfg.head_dim)
            t[q : q + k] = interleave_rows(t[q : q + k], cfg.num_kv_heads, cfg.head_dim)


def _shard_sizes(cfg: ModelConfig) -> dict[str, list[int]]:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "qkv_proj": [q, kv, kv],
        "gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
    }


def _check_complete(
    params: dict[str, torch.nn.Parameter],
    shard_sizes: dict[str, list[int]],
    loaded: set[tuple[str, int | None]],
    cfg: ModelConfig,
) -> None:
    missing = []
    for name in params:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        fused = name.split(".")[-2]
        shards: list[int | None] = (
            list(range(len(shard_sizes[fused]))) if fused in shard_sizes else [None]
        )
        missing += [
            f"{name}[{s}]" if s is not None else name for s in shards if (name, s) not in loaded
        ]
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ConfigError(f"the checkpoint is missing {len(missing)} tensors: {shown}")

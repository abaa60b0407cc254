"""Tiny random Qwen3.5 checkpoints (hybrid: Gated-DeltaNet linear-attention layers among gated
full-attention ones), built with transformers' own classes: the text model
(`Qwen3_5ForCausalLM`) and the same text weights inside a vision-language checkpoint
(`Qwen3_5ForConditionalGeneration`, weights under `model.language_model.*`, a tiny vision
tower beside them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from conftest import TINY, build_tokenizer

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
# head_dim 32 != 64 / 4, partial rotary (8 of 32 dims), two key heads shared by four value
# heads in the linear layers
TEXT: dict[str, Any] = {
    **TINY,
    "num_hidden_layers": 4,
    "layer_types": LAYER_TYPES,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
}
VISION: dict[str, Any] = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64
)
ARCHS = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")


def text_config(**overrides: Any) -> Any:
    import transformers

    return transformers.Qwen3_5TextConfig(**{**TEXT, **overrides})


def hf_config(arch: str) -> dict[str, Any]:
    """The config.json of `arch`'s test checkpoint (as the docs' table reads it)."""
    import transformers

    if arch == "Qwen3_5ForCausalLM":
        return text_config().to_dict() | {"architectures": [arch]}
    cfg = transformers.Qwen3_5Config(text_config=TEXT, vision_config=VISION)
    return cfg.to_dict() | {"architectures": [arch]}


@torch.no_grad()
def build_text_model(seed: int = 0, **overrides: Any) -> Any:
    """A random Qwen3_5ForCausalLM with its norm weights and the linear layers' decay
    parameters drawn away from their init."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(text_config(**overrides)).eval()
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", "dt_bias", "A_log")):
            p.copy_(p + 0.3 * torch.randn_like(p))
    return model


@torch.no_grad()
def make_checkpoints(root: Path) -> dict[str, Path]:
    """Both architectures' checkpoints of the same text weights, by architecture."""
    import transformers

    text = build_text_model()
    paths = {arch: root / arch for arch in ARCHS}
    text.save_pretrained(paths[ARCHS[0]], safe_serialization=True)
    torch.manual_seed(1)
    vl = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=TEXT, vision_config=VISION)
    ).eval()
    vl.model.language_model.load_state_dict(text.model.state_dict())
    vl.lm_head.load_state_dict(text.lm_head.state_dict())
    vl.save_pretrained(paths[ARCHS[1]], safe_serialization=True)
    for path in paths.values():
        build_tokenizer(path)
    return paths

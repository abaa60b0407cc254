"""Tiny random checkpoints of every dense family, built with transformers' own config and model
classes, each with its family's features switched on where a tiny model feels them: small
soft-caps, windows shorter than the test sequences, norm weights away from their init, a
head_dim other than hidden / heads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from conftest import TINY, build_tokenizer

WINDOW = 12  # shorter than most test sequences
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]

# name -> (transformers config class, model class, overrides of TINY)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # q/k norms per head, head_dim 32 != 64 / 4, untied
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    # soft-caps that bind, alternate windowed layers, sandwich (1 + w) norms, GeLU-tanh,
    # sqrt(hidden) embeddings, query_pre_attn_scalar != head_dim
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=32,
            num_hidden_layers=4,
            query_pre_attn_scalar=20,
            attn_logit_softcapping=0.6,
            final_logit_softcapping=1.2,
            sliding_window=WINDOW,
            tie_word_embeddings=False,
        ),
    ),
    # q/k norms, a sliding / global pattern, its own rope on windowed layers (and linear
    # scaling on the global ones)
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=32,
            num_hidden_layers=4,
            layer_types=LAYER_TYPES,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
            tie_word_embeddings=True,
        ),
    ),
    # fused qkv / gate_up in the checkpoint, partial rotary, a window on every layer
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            partial_rotary_factor=0.5,
            sliding_window=40,
            tie_word_embeddings=False,
            initializer_range=0.3,
        ),
    ),
    # norms after attention and MLP only, q/k norms over the whole projection
    "olmo2": (
        "Olmo2Config",
        "Olmo2ForCausalLM",
        dict(tie_word_embeddings=False, initializer_range=0.1),
    ),
    # the four multipliers
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            embedding_multiplier=6.0,
            residual_multiplier=0.5,
            attention_multiplier=0.4,
            logits_scaling=0.5,
            tie_word_embeddings=True,
            initializer_range=0.3,
        ),
    ),
    # a NoPE layer every other layer (no_rope_layers: 1 = rope, 0 = none)
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(
            num_hidden_layers=4,
            no_rope_layers=[1, 0, 1, 0],
            tie_word_embeddings=True,
            initializer_range=0.3,
        ),
    ),
    # mixtures of experts (MOE below)
    # top-2 of 4, renormalised
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, initializer_range=0.1
        ),
    ),
    # top-2 of 8 without renormalising, a gated shared expert, a dense layer among sparse ones
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[1],
            initializer_range=0.1,
            tie_word_embeddings=False,
        ),
    ),
    # q/k norms, top-3 of 8 renormalised
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            initializer_range=0.1,
        ),
    ),
    # attention sinks, windowed / global layers, biased router and experts, clamped SwiGLU,
    # gate and up interleaved in one stacked tensor
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=64,
            sliding_window=WINDOW,
            swiglu_limit=0.5,
            initializer_range=0.1,
        ),
    ),
    # multi-head latent attention (queries through q_lora, half-split rope rows, a cache of
    # latents), DeepSeek's MoE: sigmoid scores, the best group of two, a shared expert,
    # routed_scaling_factor, the first layer dense
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=24,
            rope_interleave=False,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            moe_intermediate_size=32,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            initializer_range=0.1,
            tie_word_embeddings=False,
        ),
    ),
}
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3")
DENSE = tuple(name for name in FAMILIES if name not in MOE)

# the same family with the features its config switches off (what they change must be seen in
# HF's own output, or a parity test could not fail for them: tests/test_families.py checks it);
# q/k norms and norm placement are structural (no switch): the perturbed norm weights make
# them count
FEATURES_OFF: dict[str, dict[str, Any]] = {
    "gemma2": dict(
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        layer_types=["full_attention"] * 4,
    ),
    "gemma3": dict(layer_types=["full_attention"] * 4),
    "phi3": dict(partial_rotary_factor=1.0, sliding_window=None),
    "granite": dict(
        embedding_multiplier=1.0,
        residual_multiplier=1.0,
        attention_multiplier=0.25,
        logits_scaling=1.0,
    ),
    "smollm3": dict(no_rope_layers=[1, 1, 1, 1]),
    "qwen2_moe": dict(mlp_only_layers=[]),
    "qwen3_moe": dict(norm_topk_prob=False),
    "gpt_oss": dict(layer_types=["full_attention"] * 2, swiglu_limit=7.0),
}


def hf_classes(name: str) -> tuple[Any, Any]:
    import transformers

    config_cls, model_cls, _ = FAMILIES[name]
    return getattr(transformers, config_cls), getattr(transformers, model_cls)


def family_config(name: str, **overrides: Any) -> Any:
    config_cls, _ = hf_classes(name)
    return config_cls(**{**TINY, **FAMILIES[name][2], **overrides})


@torch.no_grad()
def build_family_model(name: str, seed: int = 0, **overrides: Any) -> Any:
    """A random model of `name` with its norm weights drawn away from their init (so that a
    norm weight loaded into the wrong place, or permuted wrongly, changes the output)."""
    _, model_cls = hf_classes(name)
    torch.manual_seed(seed)
    model = model_cls(family_config(name, **overrides)).eval()
    for param_name, p in model.named_parameters():
        if param_name.endswith(("norm.weight", "sinks", "bias")):  # gpt-oss: sinks, biases
            p.copy_(p + 0.3 * torch.randn_like(p))
    return model


def make_family_checkpoint(path: Path, name: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random `name` checkpoint (fp32 safetensors + tokenizer) to `path`."""
    model = build_family_model(name, seed, **overrides)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path)
    return path

"""The model families: what each adds to the Llama decoder, declared once.

One decoder (model/decoder.py; a mixture of experts in place of the MLP: model/moe_block.py) is
assembled from the features a `Family` row names; the
per-model values (window sizes, multipliers, rope bases, ...) are read from the HF
`config.json` by `model_config.ModelConfig.from_hf`. A new dense family is a row here plus its
parity test (DESIGN.md: the decoder from parts).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    # q/k/v biases whatever `attention_bias` says (Qwen2); otherwise `attention_bias` sets the
    # q/k/v and o biases together
    qkv_bias: bool = False
    # RMSNorm of q and k before the rotation: "head" over each head (Qwen3, Gemma 3), "proj"
    # over the whole projection (OLMo 2)
    qk_norm: str | None = None
    # where the layer norms sit: "pre" before attention and MLP (Llama), "sandwich" before
    # and after both (Gemma 2/3), "post" after both only (OLMo 2)
    norms: str = "pre"
    # RMSNorm scales by (1 + w) (Gemma)
    unit_offset_norm: bool = False
    # the embeddings times sqrt(hidden_size) (Gemma)
    scaled_embedding: bool = False
    # the softmax scale is query_pre_attn_scalar ** -0.5 (Gemma)
    query_pre_attn_scalar: bool = False
    # Granite's embedding_multiplier, residual_multiplier, attention_multiplier and
    # logits_scaling
    multipliers: bool = False
    # the config flag that switches `sliding_window` on (None: a window in the config is used)
    window_flag: str | None = None
    # without `layer_types` in the config: every n-th layer is global, the others windowed
    # (Gemma 2: 2; Gemma 3: its `sliding_window_pattern`, 6 by default); None: all windowed
    global_every: int | None = None
    # windowed layers use their own rope (Gemma 3: `rope_local_base_freq`, no scaling)
    local_rope: bool = False
    # layers without rotary on the `no_rope_layers` pattern (SmolLM3: 1 = rope, 0 = NoPE)
    nope_layers: bool = False
    # mixture of experts (moe_config.py): "mixtral", "qwen_moe", "gpt_oss" or "deepseek"
    # routing and layout
    moe: str | None = None
    # a learned per-head logit in each attention softmax (gpt-oss)
    attn_sinks: bool = False
    # multi-head latent attention (mla_config.py, model/mla.py): the paged cache holds one
    # compressed latent and one rotated key per token (DeepSeek-V2/V3)
    mla: bool = False
    # Gated-DeltaNet linear-attention layers (a recurrent state per request, no KV cache)
    # among gated full-attention ones (hybrid_config.py, model/gdn_block.py)
    hybrid: bool = False


# HF architecture -> its features. Fused q/k/v and gate/up checkpoints (Phi-3) need no
# feature: the loader takes either layout.
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(),
    "Qwen2ForCausalLM": Family(qkv_bias=True, window_flag="use_sliding_window"),
    "Qwen3ForCausalLM": Family(qk_norm="head", window_flag="use_sliding_window"),
    "Gemma2ForCausalLM": Family(
        norms="sandwich",
        unit_offset_norm=True,
        scaled_embedding=True,
        query_pre_attn_scalar=True,
        global_every=2,
    ),
    "Gemma3ForCausalLM": Family(
        qk_norm="head",
        norms="sandwich",
        unit_offset_norm=True,
        scaled_embedding=True,
        query_pre_attn_scalar=True,
        global_every=6,
        local_rope=True,
    ),
    "Phi3ForCausalLM": Family(),
    "Olmo2ForCausalLM": Family(qk_norm="proj", norms="post"),
    "GraniteForCausalLM": Family(multipliers=True),
    "SmolLM3ForCausalLM": Family(window_flag="use_sliding_window", nope_layers=True),
    "MixtralForCausalLM": Family(moe="mixtral"),
    "Qwen2MoeForCausalLM": Family(qkv_bias=True, window_flag="use_sliding_window", moe="qwen_moe"),
    "Qwen3MoeForCausalLM": Family(qk_norm="head", window_flag="use_sliding_window", moe="qwen_moe"),
    "GptOssForCausalLM": Family(moe="gpt_oss", attn_sinks=True),
    "DeepseekV3ForCausalLM": Family(moe="deepseek", mla=True),
    "Qwen3_5ForCausalLM": Family(qk_norm="head", unit_offset_norm=True, hybrid=True),
}
# vision-language architectures served as their text model (hybrid_config.text_config)
TEXT_OF = {"Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM"}

SUPPORTED_ARCHITECTURES = (*FAMILIES, *TEXT_OF)

# HF activation names -> ours
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "gelu": "gelu",
}

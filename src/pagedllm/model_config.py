"""The model's configuration, read from a HF `config.json` in one place: its shape, and the
features its family (families.py) turns on, resolved to per-model and per-layer values."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.errors import ConfigError
from pagedllm.families import ACTIVATIONS, FAMILIES, SUPPORTED_ARCHITECTURES, Family
from pagedllm.hybrid_config import HybridConfig, text_config
from pagedllm.hybrid_config import from_hf as hybrid_from_hf
from pagedllm.mla_config import MlaConfig
from pagedllm.mla_config import from_hf as mla_from_hf
from pagedllm.moe_config import MoeConfig
from pagedllm.moe_config import from_hf as moe_from_hf

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # llama3, yarn, longrope: the context the model was pretrained with
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # yarn, longrope: the cos/sin scaling (None: derived from the factor)
    attention_factor: float | None = None
    # longrope: per-frequency factors within / past the original context
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # the share of head_dim that is rotated (the first dims of each head)
    partial_rotary_factor: float = 1.0

    @staticmethod
    def from_hf(hf: dict[str, Any], params: dict[str, Any] | None = None) -> RopeConfig:
        """transformers >= 5 writes `rope_parameters` (theta inside; per layer type for
        Gemma 3); 4.x writes `rope_theta` and an optional `rope_scaling` dict whose type key
        is `rope_type` or the older `type`. `params`: the dict to read (default: the model's).
        Defaults are those transformers derives (standardize_rope_params and the rope init
        functions in modeling_rope_utils)."""
        nested = params is not None
        if params is None:
            params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "su" or (rope_type == "yarn" and hf.get("model_type") == "phi3"):
            rope_type = "longrope"  # Phi-3's earlier names for longrope
        if rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )
        if rope_type == "longrope" and not (
            params.get("short_factor") and params.get("long_factor")
        ):
            raise ConfigError("longrope scaling needs both `short_factor` and `long_factor`")
        original = RopeConfig._original_context(hf, params, rope_type, nested)
        factor = params.get("factor")
        if factor is None and rope_type in ("yarn", "longrope") and original:
            # the factor of DeepSeek-V3 and Phi-3 configs: the stretch of the context
            factor = hf.get("max_position_embeddings", original) / original
        partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))

        def opt(key: str) -> float | None:
            return None if params.get(key) is None else float(params[key])

        return RopeConfig(
            theta=float(theta),
            type=rope_type,
            factor=float(factor or 1.0),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=opt("mscale"),
            mscale_all_dim=opt("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
            attention_factor=opt("attention_factor"),
            short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
            long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
            partial_rotary_factor=float(partial or 1.0),
        )

    @staticmethod
    def _original_context(
        hf: dict[str, Any], params: dict[str, Any], rope_type: str, nested: bool
    ) -> int | None:
        """`original_max_position_embeddings` where transformers reads it: for a flat rope dict a
        top-level value wins over the dict's (Phi-3 writes it there; Phi3Config defaults it to
        4096); then the dict's; None: max_position_embeddings (resolved in model/rope.py)."""
        if rope_type not in ("llama3", "yarn", "longrope"):
            return None
        if not nested and hf.get("model_type") == "phi3":
            return int(hf.get("original_max_position_embeddings") or 4096)
        top = None if nested else hf.get("original_max_position_embeddings")
        value = top or params.get("original_max_position_embeddings")
        return None if value is None else int(value)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of the model and the features of its family, resolved from `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    # the rope of the global layers first; then, for a family with its own rope on windowed
    # layers (Gemma 3), that one
    ropes: tuple[RopeConfig, ...]
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    # per layer: its sliding window (None: global attention) and the index of its rope in
    # `ropes` (None: no rotary, NoPE)
    layer_windows: tuple[int | None, ...]
    layer_ropes: tuple[int | None, ...]
    checkpoint_dtype: str | None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # family features (families.Family), with their values
    qk_norm: str | None = None  # "head" | "proj"
    norms: str = "pre"  # "pre" | "sandwich" | "post"
    unit_offset_norm: bool = False
    activation: str = "silu"  # "silu" | "gelu_tanh" | "gelu"
    embed_scale: float = 1.0
    residual_scale: float = 1.0  # the attention and MLP outputs times this before the residual
    attn_scale: float | None = None  # the softmax scale (None: head_dim ** -0.5)
    attn_softcap: float | None = None  # attention logits capped as cap * tanh(s / cap)
    logit_scale: float = 1.0  # the final logits times this
    final_softcap: float | None = None  # then capped as cap * tanh(x / cap)
    attn_sinks: bool = False  # a learned logit per head in each softmax
    # mixture of experts: its settings, and per layer whether it has them (else the dense MLP)
    moe: MoeConfig | None = None
    layer_moe: tuple[bool, ...] = ()
    # multi-head latent attention in place of q/k/v (then head_dim is its rotated dims,
    # qk_rope_head_dim, as transformers sets it)
    mla: MlaConfig | None = None
    hybrid: HybridConfig | None = None  # linear-attention layers among the others (Qwen3.5)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.rotary_dim % 2 or self.head_dim % 2:
            raise ConfigError(
                f"the rotated dims ({self.rotary_dim}) of head_dim {self.head_dim} must be even"
            )

    @property
    def rope(self) -> RopeConfig:
        """The global layers' rope."""
        return self.ropes[0]

    @property
    def rotary_dim(self) -> int:
        """The dims of each head that are rotated (the first ones; partial rotary)."""
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def kv_values_per_token(self, world: int = 1) -> int:
        """Values a layer caches per token on a rank: MLA's latent and rotated key (the same on
        every rank), else the rank's KV heads' keys and values."""
        if self.mla is not None:
            return self.mla.cache_dim
        return 2 * max(1, self.num_kv_heads // world) * self.head_dim

    @property
    def num_kv_layers(self) -> int:
        """The layers with a KV cache (a hybrid's linear ones hold none)."""
        return self.num_layers - (self.hybrid.num_linear if self.hybrid else 0)

    @property
    def sliding_window(self) -> int | None:
        """The window when every layer has the same one, else None (no layer, or a mix)."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    @property
    def num_parameters(self) -> int:
        """Parameters of the model this config describes (embeddings counted once when tied)."""
        h, hd, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0)
        attn += h if self.o_bias else 0
        attn += {"head": 2 * hd, "proj": q + kv}.get(self.qk_norm or "", 0)
        if self.mla is not None:
            attn = self.mla.num_parameters(h, self.num_heads, self.o_bias)
        attn += self.num_heads if self.attn_sinks else 0
        dense = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        norms = {"pre": 2, "sandwich": 4, "post": 2}[self.norms]
        moe, sparse = self.moe, sum(self.layer_moe)
        mlps = (self.num_layers - sparse) * dense
        if moe is not None:
            e, ie, s = moe.num_experts, moe.intermediate_size, moe.shared_intermediate_size
            experts = e * (3 * h * ie + ((2 * ie + h) if moe.expert_bias else 0))
            router = e * h + (e if moe.router_bias else 0)
            shared = 3 * h * s + h if s else 0
            mlps += sparse * (experts + router + shared)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + norms * h) + mlps + embed + h

    @property
    def context_length(self) -> int:
        """`linear` and `dynamic` rope scaling stretch the trained context by their factor;
        `yarn` stretches the original one (Qwen2.5 / Qwen3 keep max_position_embeddings at
        the original length, DeepSeek writes the stretched one: the larger of the two)."""
        rope = self.rope
        if rope.type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * rope.factor)
        if rope.type == "yarn" and rope.original_max_position_embeddings:
            stretched = int(rope.original_max_position_embeddings * rope.factor)
            return max(self.max_position_embeddings, stretched)
        return self.max_position_embeddings

    @staticmethod
    def from_model_dir(model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        if not path.is_dir():
            raise ConfigError(f"model directory {str(path)!r} does not exist")
        hf = read_json(path / "config.json")
        gen_path = path / "generation_config.json"
        gen = read_json(gen_path) if gen_path.exists() else {}
        return ModelConfig.from_hf(hf, gen)

    @staticmethod
    def from_hf(hf: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        hf = text_config(hf)  # a vision-language checkpoint's text model
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in FAMILIES), None)
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = FAMILIES[arch]
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise ConfigError(
                f"unsupported activation {act!r}; supported: {', '.join(ACTIVATIONS)}"
            )
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        num_layers = hf["num_hidden_layers"]
        eos = _ids((generation or {}).get("eos_token_id")) or _ids(hf.get("eos_token_id"))
        bias = bool(hf.get("attention_bias", False))
        windows = _layer_windows(hf, family, num_layers)
        ropes, layer_ropes = _ropes(hf, family, windows)
        moe, layer_moe = None, (False,) * num_layers
        if family.moe is not None:
            moe, layer_moe = moe_from_hf(hf, family.moe, num_layers, ACTIVATIONS[act])
        mla = mla_from_hf(hf) if family.mla else None
        if mla is not None:  # transformers' head_dim: the rotated dims
            head_dim = mla.qk_rope_head_dim
        return ModelConfig(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            ropes=ropes,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias or bias,
            o_bias=not family.qkv_bias and bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            layer_windows=windows,
            layer_ropes=layer_ropes,
            checkpoint_dtype=hf.get("dtype") or hf.get("torch_dtype"),
            eos_token_ids=eos,
            bos_token_id=hf.get("bos_token_id"),
            qk_norm=family.qk_norm,
            norms=family.norms,
            unit_offset_norm=family.unit_offset_norm,
            activation=ACTIVATIONS[act],
            embed_scale=_embed_scale(hf, family),
            residual_scale=float(hf.get("residual_multiplier", 1.0)) if family.multipliers else 1.0,
            attn_scale=_attn_scale(hf, family) if mla is None else mla.softmax_scale(ropes[0]),
            attn_softcap=_positive(hf.get("attn_logit_softcapping")),
            logit_scale=1.0 / float(hf.get("logits_scaling", 1.0)) if family.multipliers else 1.0,
            final_softcap=_positive(hf.get("final_logit_softcapping")),
            attn_sinks=family.attn_sinks,
            moe=moe,
            layer_moe=layer_moe,
            mla=mla,
            hybrid=hybrid_from_hf(hf, num_layers) if family.hybrid else None,
        )


def _layer_windows(hf: dict[str, Any], family: Family, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window: `layer_types` where the config lists them, else the
    family's pattern."""
    window = hf.get("sliding_window")
    if family.window_flag is not None and not hf.get(family.window_flag, False):
        window = None
    if not window:
        return (None,) * num_layers
    types = hf.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ConfigError(f"layer_types lists {len(types)} layers, the model has {num_layers}")
        return tuple(window if t == "sliding_attention" else None for t in types)
    every = hf.get("sliding_window_pattern", family.global_every)
    if every is None:
        return (window,) * num_layers
    return tuple(window if (i + 1) % every else None for i in range(num_layers))


def _ropes(
    hf: dict[str, Any], family: Family, windows: tuple[int | None, ...]
) -> tuple[tuple[RopeConfig, ...], tuple[int | None, ...]]:
    """The distinct ropes and each layer's (None: NoPE)."""
    n = len(windows)
    params = hf.get("rope_parameters")
    if family.local_rope:
        if isinstance(params, dict) and "full_attention" in params:
            full = RopeConfig.from_hf(hf, dict(params["full_attention"]))
            local = RopeConfig.from_hf(hf, dict(params.get("sliding_attention") or {}))
        else:  # 4.x: rope_theta + rope_scaling for global layers, rope_local_base_freq
            full = RopeConfig.from_hf(hf)
            theta = hf.get("rope_local_base_freq", 10000.0)
            local = RopeConfig(theta=float(theta), partial_rotary_factor=full.partial_rotary_factor)
        return (full, local), tuple(0 if w is None else 1 for w in windows)
    layers: tuple[int | None, ...] = (0,) * n
    if family.nope_layers:
        uses = hf.get("no_rope_layers")
        if uses is None:
            every = hf.get("no_rope_layer_interval", 4)
            uses = [int((i + 1) % every != 0) for i in range(n)]
        if len(uses) != n:
            raise ConfigError(f"no_rope_layers lists {len(uses)} layers, the model has {n}")
        layers = tuple(0 if u else None for u in uses)
    return (RopeConfig.from_hf(hf),), layers


def _embed_scale(hf: dict[str, Any], family: Family) -> float:
    if family.scaled_embedding:
        return float(hf["hidden_size"]) ** 0.5
    if family.multipliers:
        return float(hf.get("embedding_multiplier", 1.0))
    return 1.0


def _attn_scale(hf: dict[str, Any], family: Family) -> float | None:
    if family.query_pre_attn_scalar:
        return float(hf["query_pre_attn_scalar"]) ** -0.5
    if family.multipliers and hf.get("attention_multiplier") is not None:
        return float(hf["attention_multiplier"])
    return None


def _positive(value: Any) -> float | None:
    return float(value) if value else None


def read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"missing {path.name} in {str(path.parent)!r}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def _ids(value: Any) -> tuple[int, ...]:
    return () if value is None else (value,) if isinstance(value, int) else tuple(map(int, value))

"""The hybrid part of a model's configuration (Qwen3.5): which layers are Gated-DeltaNet linear
attention (a recurrent state per request instead of a KV cache), their sizes, and the gated
full attention of the others, read from its HF `config.json`. A vision-language checkpoint
(`Qwen3_5ForConditionalGeneration`) nests the text model's config under `text_config`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.errors import ConfigError
from pagedllm.families import TEXT_OF

if TYPE_CHECKING:
    from pagedllm.layers.gated_delta import GdnShape

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HybridConfig:
    """`layer_linear[i]`: layer i is a Gated-DeltaNet layer (else gated full attention: the
    q projection also yields a per-head output gate, o = attn * sigmoid(gate))."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    layer_linear: tuple[bool, ...]

    @property
    def shape(self) -> GdnShape:
        from pagedllm.layers.gated_delta import GdnShape

        return GdnShape(
            self.key_heads, self.value_heads, self.key_dim, self.value_dim, self.conv_kernel
        )

    @property
    def num_linear(self) -> int:
        return sum(self.layer_linear)

    def state_bytes_per_slot(self, dtype_size: int) -> int:
        """One request's state over every linear layer: the conv window (activations' dtype)
        and the fp32 recurrent state."""
        s = self.shape
        conv = s.conv_dim * (s.conv_kernel - 1) * dtype_size
        ssm = s.value_heads * s.key_dim * s.value_dim * 4
        return self.num_linear * (conv + ssm)

    def num_parameters(self, hidden: int) -> int:
        """One linear layer's token mixer: the in/out projections, conv, gates and norm."""
        s = self.shape
        value = s.value_heads * s.value_dim
        in_proj = hidden * (s.conv_dim + value + 2 * s.value_heads)
        return (
            in_proj + s.conv_dim * s.conv_kernel + 2 * s.value_heads + s.value_dim + value * hidden
        )


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config's text part, under the text architecture; others as they are."""
    arch = next((TEXT_OF[a] for a in hf.get("architectures") or [] if a in TEXT_OF), None)
    if arch is None:
        return hf
    text = dict(hf.get("text_config") or {})
    if not text:
        raise ConfigError(f"{arch} config without text_config")
    return {**text, "architectures": [arch], "tie_word_embeddings": hf.get(
        "tie_word_embeddings", text.get("tie_word_embeddings", False))}  # fmt: skip


def from_hf(hf: dict[str, Any], num_layers: int) -> HybridConfig:
    types = hf.get("layer_types")
    if types is None:
        every = int(hf.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(num_layers)]  # fmt: skip
    if len(types) != num_layers or set(types) - {"linear_attention", "full_attention"}:
        raise ConfigError(f"layer_types {types!r} for {num_layers} layers")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError("Gated-DeltaNet layers support the silu activation only")
    return HybridConfig(
        key_heads=int(hf["linear_num_key_heads"]),
        value_heads=int(hf["linear_num_value_heads"]),
        key_dim=int(hf["linear_key_head_dim"]),
        value_dim=int(hf["linear_value_head_dim"]),
        conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)),
        layer_linear=tuple(t == "linear_attention" for t in types),
    )


def size_state_pool(
    hybrid: HybridConfig,
    num_state_slots: int | None,
    max_num_seqs: int,
    budget: int | None,
    dtype_size: int,
) -> tuple[int, int]:
    """(state slots, their bytes: reserved out of the KV pool's memory). Unless given, one slot
    per sequence the scheduler may run (`max_num_seqs`), capped on a CPU at what half of its
    `budget` (kv_cache_memory) holds; a request beyond them waits for a slot, as for blocks."""
    per_slot = hybrid.state_bytes_per_slot(dtype_size)
    slots = num_state_slots or max_num_seqs
    if num_state_slots is None and budget is not None:
        slots = max(1, min(slots, budget // 2 // max(1, per_slot)))
    if slots < 1:
        raise ConfigError(f"num_state_slots must be >= 1, got {slots}")
    return slots, slots * per_slot


def prefix_caching(enabled: bool, arch: str) -> bool:
    """Prefix caching is off for hybrid models: a cached block restores the attention layers'
    keys but not the linear layers' recurrent state after it, which no block holds."""
    if enabled:
        logger.info("prefix caching is disabled for %s: its linear-attention layers keep a "
                    "recurrent state per request, not per block", arch)  # fmt: skip
    return False

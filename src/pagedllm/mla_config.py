"""The multi-head latent attention (MLA) part of a model's configuration (DeepSeek-V2/V3), read
from its HF `config.json`: the ranks of the low-rank projections and the per-head widths."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from pagedllm.errors import ConfigError


class ScaledRope(Protocol):
    """What the softmax scale reads of a rope (model_config.RopeConfig has it)."""

    @property
    def type(self) -> str: ...
    @property
    def factor(self) -> float: ...
    @property
    def mscale_all_dim(self) -> float | None: ...


@dataclass(frozen=True)
class MlaConfig:
    """Each token's keys and values are one `kv_lora_rank` latent (normed, cached) that
    kv_b_proj expands per head into k_nope (`qk_nope_head_dim`) and v (`v_head_dim`), plus one
    `qk_rope_head_dim` rotated key shared by every head (cached beside the latent). Queries:
    q_a_proj -> q_a_layernorm -> q_b_proj when `q_lora_rank`, else q_proj; each head is
    [nope | rope]."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    # the checkpoint's rotated dims are pairs (2i, 2i+1), as ours (else half-split: the loader
    # permutes the rope rows of q and of the shared key)
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values one layer caches per token: the normed latent, then the rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def softmax_scale(self, rope: ScaledRope) -> float:
        """qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) squared where the
        rope is scaled and the config gives `mscale_all_dim` (transformers'
        `yarn_apply_mscale`)."""
        scale = self.qk_head_dim**-0.5
        if rope.type != "default" and rope.mscale_all_dim:
            factor = rope.factor
            mscale = 1.0 if factor <= 1 else 0.1 * rope.mscale_all_dim * math.log(factor) + 1.0
            scale *= mscale * mscale
        return scale

    def num_parameters(self, hidden: int, heads: int, bias: bool) -> int:
        """One layer's attention parameters (norms included)."""
        q_out = heads * self.qk_head_dim
        rank, kv_a = self.q_lora_rank, self.cache_dim
        q = hidden * q_out if rank is None else hidden * rank + rank + rank * q_out
        kv = hidden * kv_a + self.kv_lora_rank
        kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        o = heads * self.v_head_dim * hidden
        biases = ((rank or 0) + kv_a + hidden) if bias else 0
        return q + kv + o + biases


def from_hf(hf: dict[str, Any]) -> MlaConfig:
    try:
        return MlaConfig(
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            q_lora_rank=None if hf.get("q_lora_rank") is None else int(hf["q_lora_rank"]),
            rope_interleave=bool(hf.get("rope_interleave", True)),
        )
    except KeyError as e:
        raise ConfigError(f"a latent-attention config needs {e.args[0]}") from e

"""Rotary position embeddings with the `linear`, `dynamic` (NTK), `llama3`, `yarn` and
`longrope` scalings, as transformers computes them (half-split rotation, fp32 angles, the
same order of fp32 operations, so the tables agree to the last bits)."""

from __future__ import annotations

import math

import torch

from pagedllm.config import RopeConfig
from pagedllm.errors import ConfigError


def _inv_freq(theta: float | torch.Tensor, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if isinstance(theta, torch.Tensor):  # one base per position: (P, 1) -> (P, dim / 2)
        return 1.0 / theta.unsqueeze(-1) ** exponents
    return 1.0 / (theta**exponents)


def _original(rope: RopeConfig, max_pos: int) -> int:
    """The pretrained context (transformers' default: max_position_embeddings)."""
    return rope.original_max_position_embeddings or max_pos


def _llama3_inv_freq(rope: RopeConfig, dim: int, max_pos: int) -> torch.Tensor:
    inv_freq = _inv_freq(rope.theta, dim)
    old_len = _original(rope, max_pos)
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(rope: RopeConfig, dim: int, max_pos: int) -> torch.Tensor:
    """The frequencies that turn fewer than `beta_slow` times over the original context are
    interpolated (/ factor), those that turn more than `beta_fast` times are kept
    (extrapolated), with a linear ramp over the dims between."""
    original = _original(rope, max_pos)

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    keep = 1 - ramp  # (dim / 2,) the share of each frequency left unscaled
    return interpolation * (1 - keep) + extrapolation * keep


def _longrope_inv_freq(rope: RopeConfig, factors: tuple[float, ...], dim: int) -> torch.Tensor:
    if len(factors) != dim // 2:
        raise ConfigError(
            f"longrope needs {dim // 2} short and long factors (rotated dims {dim}), "
            f"got {len(rope.short_factor)} and {len(rope.long_factor)}"
        )
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**shape)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(rope: RopeConfig, max_pos: int) -> float:
    """The factor transformers multiplies cos and sin by (`attention_scaling`): 1 but for
    `yarn` and `longrope`, whose default it derives from the factor when the config gives none."""
    if rope.type not in ("yarn", "longrope"):
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.type == "yarn":
        if rope.mscale and rope.mscale_all_dim:
            return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(
                rope.factor, rope.mscale_all_dim
            )
        return _yarn_mscale(rope.factor)
    if rope.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(rope.factor) / math.log(_original(rope, max_pos)))


def _angles(rope: RopeConfig, dim: int, max_pos: int, positions: torch.Tensor) -> torch.Tensor:
    """(P, dim / 2) fp32 angles position * inverse frequency."""
    if rope.type == "dynamic":
        seq_len = torch.clamp(positions + 1, min=max_pos)
        base = rope.theta * (rope.factor * seq_len / max_pos - (rope.factor - 1)) ** (
            dim / (dim - 2)
        )
        return positions[:, None] * _inv_freq(base, dim)
    if rope.type == "longrope":
        short = _longrope_inv_freq(rope, rope.short_factor, dim)
        long = _longrope_inv_freq(rope, rope.long_factor, dim)
        past = (positions >= _original(rope, max_pos))[:, None]  # (P, 1)
        return positions[:, None] * torch.where(past, long, short)
    if rope.type == "llama3":
        inv_freq = _llama3_inv_freq(rope, dim, max_pos)
    elif rope.type == "yarn":
        inv_freq = _yarn_inv_freq(rope, dim, max_pos)
    else:
        inv_freq = _inv_freq(rope.theta, dim)
        if rope.type == "linear":
            inv_freq = inv_freq / rope.factor
    return positions[:, None] * inv_freq[None, :]


def rope_cos_sin(
    rope: RopeConfig, dim: int, max_pos: int, num_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, (num_positions, dim / 2) fp32, for positions 0..num_positions-1
    of the `dim` rotated dims, times the attention factor (yarn, longrope) as transformers
    scales them. `max_pos`: the model's max_position_embeddings.

    NOTE: `dynamic` scaling and `longrope` are made stateless: position p uses what
    transformers' rotary module uses for a sequence of p + 1 tokens: for `dynamic` the NTK
    base of p + 1 tokens; for `longrope` the short factors below the original context
    (`original_max_position_embeddings`) and the long ones from there on. That is
    transformers' model run one token at a time on its KV cache after a prompt within the
    original context. Where transformers rotates a sequence longer than the original context
    at once, it differs: a prompt that long gets one base (dynamic: that of its length) or
    the long factors at every position (longrope); and Phi-3's `generate` drops its KV cache
    when the sequence first passes the original context, re-encoding it all with the long
    factors, whereas the keys we cached below the original context keep the short ones.
    """
    positions = torch.arange(num_positions, dtype=torch.int64).float()
    angles = _angles(rope, dim, max_pos, positions)
    scale = attention_factor(rope, max_pos)
    return angles.cos() * scale, angles.sin() * scale


def rotary_table(rope: RopeConfig, head_dim: int, max_pos: int, num_positions: int) -> torch.Tensor:
    """(P, head_dim / 2) complex64 `cos + i sin` for positions 0..P-1 (times the attention
    factor): a rotation is one complex multiply of the interleaved pairs (x[2i], x[2i+1]).
    With partial rotary the pairs past the rotated dims get the identity (1 + 0i), unscaled."""
    rotary_dim = int(head_dim * rope.partial_rotary_factor)
    cos, sin = rope_cos_sin(rope, rotary_dim, max_pos, num_positions)
    table = torch.complex(cos, sin)
    if rotary_dim < head_dim:
        identity = torch.ones(num_positions, (head_dim - rotary_dim) // 2, dtype=table.dtype)
        table = torch.cat([table, identity], dim=1)
    return table


def interleave_rows(
    w: torch.Tensor, num_heads: int, head_dim: int, rotary_dim: int | None = None
) -> torch.Tensor:
    """Reorder each head's rotated rows from the half-split rotary layout
    (i, i + rotary_dim/2) to the interleaved one (2i, 2i+1); rows past `rotary_dim`
    (partial rotary) stay. w: (num_heads * head_dim, ...) weight, bias or norm weight."""
    rot = head_dim if rotary_dim is None else rotary_dim
    rest = w.shape[1:]
    heads = w.reshape(num_heads, head_dim, *rest)
    rotated = heads[:, :rot].reshape(num_heads, 2, rot // 2, *rest).transpose(1, 2)
    rotated = rotated.reshape(num_heads, rot, *rest)
    return torch.cat([rotated, heads[:, rot:]], dim=1).reshape(num_heads * head_dim, *rest)

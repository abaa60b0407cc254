"""Rotary position embeddings with the `linear`, `dynamic` (NTK) and `llama3` scalings, as
transformers computes them (half-split rotation, fp32 angles)."""

from __future__ import annotations

import math

import torch

from pagedllm.config import RopeConfig


def _inv_freq(theta: float | torch.Tensor, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if isinstance(theta, torch.Tensor):  # one base per position: (P, 1) -> (P, head_dim / 2)
        return 1.0 / theta.unsqueeze(-1) ** exponents
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig, max_pos: int) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings or max_pos
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


def rope_cos_sin(
    rope: RopeConfig, head_dim: int, max_pos: int, num_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, (num_positions, head_dim / 2) fp32, for positions 0..num_positions-1.

    NOTE: `dynamic` scaling is made stateless: position p uses the base transformers uses
    once the sequence has p + 1 tokens (identical below the original context, and for every
    token decoded past it; a prompt longer than the original context is rotated per position
    rather than with one base for the whole prompt).
    """
    positions = torch.arange(num_positions, dtype=torch.int64).float()
    if rope.type == "dynamic":
        seq_len = torch.clamp(positions + 1, min=max_pos)
        base = rope.theta * (rope.factor * seq_len / max_pos - (rope.factor - 1)) ** (
            head_dim / (head_dim - 2)
        )
        angles = positions[:, None] * _inv_freq(base, head_dim)
    else:
        inv_freq = _inv_freq(rope.theta, head_dim)
        if rope.type == "linear":
            inv_freq = inv_freq / rope.factor
        elif rope.type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope, max_pos)
        angles = positions[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def rotary_table(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(P, head_dim / 2) complex64 `cos + i sin`: a rotation is one complex multiply of the
    interleaved pairs (x[2i], x[2i+1])."""
    return torch.complex(cos, sin)


def interleave_rows(w: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder each head's rows from the half-split rotary layout (i, i + head_dim/2) to the
    interleaved one (2i, 2i+1). w: (num_heads * head_dim, ...) weight or bias."""
    rest = w.shape[1:]
    w = w.reshape(num_heads, 2, head_dim // 2, *rest).transpose(1, 2)
    return w.reshape(num_heads * head_dim, *rest)

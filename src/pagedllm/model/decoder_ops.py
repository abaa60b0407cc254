"""The decoder's functions between its projections (model/decoder.py): a row-parallel linear,
a block's output joining the residual stream, the gated activation."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagedllm.layers.attention import cpu_kernels
from pagedllm.layers.quant import Weight, linear

if TYPE_CHECKING:
    from pagedllm.distributed.comm import TPGroup


def row_parallel(
    x: torch.Tensor,
    w: Weight,
    bias: torch.Tensor | None,
    tp: TPGroup | None,
    lora: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """A row-parallel linear: each rank's partial sum, plus its partial LoRA delta `lora(x,
    out)` (its columns of A: the deltas sum as the products do), all-reduced, then the bias."""
    out = linear(x, w, bias if tp is None else None)
    if lora is not None:
        lora(x, out)
    if tp is None:
        return out
    out = tp.all_reduce(out)
    return out if bias is None else out.add_(bias)


def join(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    post: torch.Tensor | None,
    pre: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pending block output `x` (normed by `post` where the family norms after a block)
    joins the stream `residual` (the first call, with none yet, starts it as x); returns the
    next block's input (the stream normed by `pre`, or the stream itself where the family
    norms before no block) and the stream. Fused on the CPU (may overwrite x and residual
    in place)."""
    if post is not None:
        x = cpu_kernels.rms_norm(x, post, eps)
    if pre is None:
        residual = x if residual is None else residual + x
        return residual, residual
    if residual is None:
        return cpu_kernels.rms_norm(x, pre, eps), x
    return cpu_kernels.fused_add_rms_norm(x, residual, pre, eps)


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """`act(gate) * up` where `gate, up = gate_up.chunk(2, -1)`."""
    if activation == "silu":
        return cpu_kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    approximate = "tanh" if activation == "gelu_tanh" else "none"
    return F.gelu(gate, approximate=approximate) * up

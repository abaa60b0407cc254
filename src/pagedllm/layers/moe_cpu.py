"""The experts of a mixture-of-experts layer on the CPU in one C++ call (csrc/moe.cpp).

The kernel groups the (token, k) pairs by expert, runs every expert's gate/up, activation and
down over its tokens (dense weights: csrc/moe_gemm.cpp's register tiles, each weight read once
for all the expert's tokens; int8 / int4: qgemv.cpp's blocks; tiles of all experts shared by
the threads at once), and sums each token's weighted outputs in fp32: what
`experts_loop` computes, without a Python loop over the experts. A quantized expert weight
meets its activations rounded to int8 in groups of 32, as `linear` does everywhere.
"""

from __future__ import annotations

import torch

from pagedllm.layers import quant
from pagedllm.layers.attention import cpu_kernels
from pagedllm.layers.moe import Experts
from pagedllm.layers.quant import QuantizedWeight, Weight

# The kernel takes up to `KERNEL_MAX_ROWS` tokens per expert for the experts' format (past
# that, `experts_loop`'s oneDNN matmul per expert wins), but at least this many: below it the
# loop's Python round per expert costs more (bf16, 64 experts, 32 tokens of top-8, up to ~10
# per expert, on an AVX-512 BF16 CPU whose 16-bit limit is 8: kernel 5.5 ms, loop 9.0 ms).
MIN_KERNEL_ROWS = 32
# fp32 experts on AVX-512: csrc/moe_gemm.cpp's tiles of 4 x 6 keep up with the loop's oneDNN
# matmul further than the linear kernels' 48 rows (64 experts of 192 x 512, every expert
# with m tokens, one thread, AMD EPYC Zen 4: loop / kernel 1.26x at m = 64, 1.15x at 96,
# 0.90x at 128).
FP32_AVX512_ROWS = 96
_AVX512 = "avx512f" in cpu_kernels.cpu_flags()

_EMPTY = torch.empty(0)


def _parts(w: Weight) -> list[torch.Tensor]:
    """[w] dense, [q, scales, mins or empty] quantized, as csrc/moe.cpp takes them (which
    refuses anything but 3-D stacks in rows: the loader does not pack expert weights)."""
    if not isinstance(w, QuantizedWeight):
        return [w]
    return [w.qweight, w.scales, _EMPTY if w.mins is None else w.mins]


def max_kernel_rows(experts: Experts) -> int:
    """The most tokens of one expert that the kernel takes (-1: any number)."""
    w = experts.w13
    # NOTE: not `quant.kernel_rows(w)`: a stacked QuantizedWeight is 3-D, as a packed one is
    if isinstance(w, QuantizedWeight):
        limit = quant.KERNEL_MAX_ROWS["quantized"]
    else:
        limit = quant.KERNEL_MAX_ROWS["fp32" if w.dtype == torch.float32 else "16-bit"]
        if limit is not None and w.dtype == torch.float32 and _AVX512:
            limit = max(limit, FP32_AVX512_ROWS)
    return -1 if limit is None else max(limit, MIN_KERNEL_ROWS)


def fused_experts_cpu(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: Experts
) -> torch.Tensor | None:
    """`experts_loop(x, topk_weights, topk_ids, experts)` in one C++ call: x (N, H) fp32 /
    bf16 / fp16 on the CPU, topk_weights (N, k), topk_ids (N, k) -> (N, H) in x's dtype.

    None where the kernel does not take it (no extension, another device, a dtype, format or
    shape it refuses, an expert with more tokens than `max_kernel_rows`): use `experts_loop`.
    With 16-bit x the kernel keeps gate_up, h and the expert outputs in fp32 and rounds once,
    at the end, where `experts_loop` rounds each to x's dtype. Raises RuntimeError for an id
    outside [0, E).
    """
    module = cpu_kernels.kernel_module()
    if module is None or x.device.type != "cpu" or x.dim() != 2:
        return None
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    out: torch.Tensor | None = module.fused_moe(
        x,
        weights,
        ids,
        _parts(experts.w13),
        experts.b13,
        _parts(experts.w2),
        experts.b2,
        experts.activation,
        float(experts.limit),
        max_kernel_rows(experts),
    )
    return out

"""The token-bitmask kernel in the Triton language (the GPU path of `layers.bitmask`): one
program per (constrained row, block of the vocabulary) writes -inf where a token's bit is 0.
Tested under the Triton interpreter on the CPU, and compiled for real GPUs in the tests."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _apply_bitmask(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    vocab,
    logits_stride,
    bitmask_stride,
    BLOCK: tl.constexpr,
):
    row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    words = tl.load(bitmask_ptr + row * bitmask_stride + offs // 32, mask=inside, other=-1)
    banned = ((words >> (offs % 32)) & 1) == 0
    tl.store(logits_ptr + row * logits_stride + offs, float("-inf"), mask=inside & banned)


def apply_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """`layers.bitmask.apply_token_bitmask_` on the logits' device (no host sync)."""
    device = logits.device
    mask = bitmask.to(device, non_blocking=True)
    index = torch.tensor(rows, dtype=torch.int32).to(device, non_blocking=True)
    vocab = logits.shape[1]
    grid = (len(rows), triton.cdiv(vocab, BLOCK))
    _apply_bitmask[grid](logits, mask, index, vocab, logits.stride(0), mask.stride(0), BLOCK=BLOCK)

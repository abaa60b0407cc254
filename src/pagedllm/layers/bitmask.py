"""A grammar's token bitmask applied to logits: a token whose bit is 0 gets -inf.

The bitmask is (rows, ceil(V / 32)) int32, bit `t % 32` of word `t // 32` for token t (the
layout llguidance and xgrammar fill). On a GPU one Triton kernel masks the constrained rows
(`bitmask_kernel.py`); on the CPU the bits are unpacked with numpy and written with one
`masked_fill_`.
"""

from __future__ import annotations

import numpy as np
import torch


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[r, t] = -inf where the bit of t in bitmask[r] is 0, for the rows in
    `rows`; the other rows' words must be all ones (on the GPU they are not read).
    `bitmask` is on the CPU, one row per row of `logits`."""
    if not rows:
        return
    if logits.is_cuda:
        from pagedllm.layers.bitmask_kernel import apply_bitmask_triton

        apply_bitmask_triton(logits, bitmask, rows)
        return
    # every row at once: the other rows' words are all ones (see `GrammarMatchers.fill`)
    # the inverted bits unpacked are 1 where banned: bytes that are already a bool mask
    banned = ~bitmask.numpy().view(np.uint8)  # little-endian words: bit order per byte
    mask = np.unpackbits(banned, axis=1, count=logits.shape[1], bitorder="little")
    logits.masked_fill_(torch.from_numpy(mask).view(torch.bool), float("-inf"))


def ban_(bitmask: torch.Tensor, row: int, ids: list[int]) -> None:
    """Clear the bits of `ids` in one row, unless they are all the row allows (a complete
    grammar allows only EOS, which `min_tokens` would ban: the grammar wins)."""
    words = bitmask[row].clone()
    for t in ids:
        if t < 32 * len(words):
            words[t // 32] &= ~(1 << (t % 32))
    if bool(words.any()):
        bitmask[row] = words


def allow_only_(bitmask: torch.Tensor, row: int, ids: list[int]) -> None:
    """Keep only the bits of `ids` in one row, unless none of them is allowed there (a
    request's allowed_token_ids against its grammar: the grammar wins)."""
    words = bitmask[row].numpy().view(np.uint32)
    ids_a = np.asarray([t for t in ids if 0 <= t < 32 * len(words)], dtype=np.int64)
    allowed = np.zeros_like(words)
    np.bitwise_or.at(allowed, ids_a // 32, np.left_shift(1, ids_a % 32).astype(np.uint32))
    kept = words & allowed
    if kept.any():
        words[:] = kept

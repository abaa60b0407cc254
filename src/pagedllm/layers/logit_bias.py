"""`logit_bias` and `allowed_token_ids` in the sampler, in vLLM's order: after the bans
(min_tokens' stop ids, bad words), before the penalties and temperature.

- A bias is added to its token's logit. It is finite (-100 to 100), so a token a grammar's mask
  or a ban set to -inf stays there: a bias never empties a grammar's mask, and under greedy
  decoding +100 makes a token win wherever it is allowed, -100 makes it lose.
- `allowed_token_ids` sets every other token to -inf. A constrained row has its allowed ids
  put into its grammar's mask instead (`ModelRunner._constrain`, `bitmask.allow_only_`: the
  grammar wins when they have no token in common); such a row (`in_mask`) is skipped here.

Ids outside the vocabulary are dropped here: a server refuses them before (the engine's
`SamplingParams.check_token_ids` with the vocabulary's size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.layers.attention.base import host_to_device
from pagedllm.sampling_params import SamplingParams


@dataclass
class LogitBias:
    """One step's biases and allowed-token masks, as tensors on the logits' device."""

    # every row's biases: (K,) row index, token id, bias; None when no row has one
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # rows limited to their allowed ids (R,), and what each keeps (R, V) bool
    allowed_rows: torch.Tensor | None
    keep: torch.Tensor | None

    @staticmethod
    def build(
        params: Sequence[SamplingParams],
        in_mask: Sequence[bool],
        vocab: int,
        device: torch.device,
    ) -> LogitBias | None:
        """None when no row has a bias or (outside a grammar's mask) allowed ids."""
        if not any(p.logit_bias or p.allowed_token_ids for p in params):
            return None
        entries = [
            (i, token, bias)
            for i, p in enumerate(params)
            for token, bias in (p.logit_bias or {}).items()
            if 0 <= token < vocab and bias != 0
        ]
        bias = None
        if entries:
            rows, tokens, values = zip(*entries, strict=True)
            bias = (
                host_to_device(list(rows), device, torch.int64),
                host_to_device(list(tokens), device, torch.int64),
                host_to_device(list(values), device, torch.float32),
            )
        limited = [
            (i, [t for t in p.allowed_token_ids if 0 <= t < vocab])
            for i, (p, masked) in enumerate(zip(params, in_mask, strict=True))
            if p.allowed_token_ids and not masked
        ]
        if not limited:
            return None if bias is None else LogitBias(bias, None, None)
        keep = torch.zeros(len(limited), vocab, dtype=torch.bool, device=device)
        at = [(r, t) for r, (_, ids) in enumerate(limited) for t in ids]
        if at:
            at_rows = host_to_device([r for r, _ in at], device, torch.int64)
            keep[at_rows, host_to_device([t for _, t in at], device, torch.int64)] = True
        allowed_rows = host_to_device([i for i, _ in limited], device, torch.int64)
        return LogitBias(bias, allowed_rows, keep)

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """In place on logits (S, V); returns them."""
        if self.bias is not None:
            rows, tokens, values = self.bias
            logits.index_put_((rows, tokens), values, accumulate=True)
        if self.allowed_rows is not None and self.keep is not None:
            limited = logits.index_select(0, self.allowed_rows)
            limited.masked_fill_(~self.keep, float("-inf"))
            logits.index_copy_(0, self.allowed_rows, limited)
        return logits

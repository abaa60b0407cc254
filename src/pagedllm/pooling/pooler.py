"""Hidden states -> one vector per sequence: LAST / MEAN / CLS pooling, then each request's
Matryoshka truncation and L2 normalisation (in that order, as vLLM's embedding head)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, lengths: list[int], pooling_type: str) -> torch.Tensor:
    """`hidden` (N, H): the sequences' tokens one after another, `lengths` of them each (all
    >= 1) -> (B, H) fp32."""
    ends = torch.tensor(lengths, device=hidden.device).cumsum(0)
    if pooling_type == "LAST":
        return hidden[ends - 1].float()
    if pooling_type == "CLS":
        return hidden[ends - ends.new_tensor(lengths)].float()
    assert pooling_type == "MEAN", pooling_type
    counts = torch.tensor(lengths, device=hidden.device)
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), counts)
    sums = torch.zeros(len(lengths), hidden.shape[1], device=hidden.device)
    sums.index_add_(0, segment, hidden.float())
    return sums / counts.unsqueeze(1)


def finish(vector: torch.Tensor, size: int, normalize: bool) -> torch.Tensor:
    """One pooled (H,) vector truncated to its first `size` values, then L2-normalised."""
    vector = vector[:size]
    return F.normalize(vector, dim=-1) if normalize else vector

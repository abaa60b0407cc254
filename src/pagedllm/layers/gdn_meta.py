"""A Gated-DeltaNet step's requests as the CPU path and the Triton kernels
(`gated_delta`, `gated_delta_triton`) both read them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch


@dataclass(frozen=True)
class GdnMeta:
    """A step's requests: token boundaries, state slots and whether each continues its slot;
    the host copies the CPU path loops over (the device tensors are what kernels read)."""

    query_start_loc: torch.Tensor  # (R+1,) int32
    state_indices: torch.Tensor  # (R,) int32
    has_initial_state: torch.Tensor  # (R,) int32, 0 / 1
    starts: tuple[int, ...]  # query_start_loc on the host
    slots: tuple[int, ...]
    continues: tuple[bool, ...]
    num_decodes: int  # leading requests with one token
    max_len: int  # the longest request's token count

    @staticmethod
    def build(
        starts: Sequence[int],
        slots: Sequence[int],
        has_initial_state: Sequence[bool],
        device: str | torch.device = "cpu",
    ) -> GdnMeta:
        assert len(starts) == len(slots) + 1 == len(has_initial_state) + 1
        lens = [b - a for a, b in pairwise(starts)]
        assert all(n > 0 for n in lens), "every request has a token"
        decodes = next((i for i, n in enumerate(lens) if n != 1), len(lens))

        def i32(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(list(values), dtype=torch.int32, device=device)

        flags = [bool(f) for f in has_initial_state]
        return GdnMeta(
            i32(starts), i32(slots), i32([int(f) for f in flags]), tuple(starts),
            tuple(slots), tuple(flags), decodes, max(lens),
        )  # fmt: skip

"""Latent attention's (model/mla.py) backend on a GPU: the latent cache write and the absorbed
decodes in Triton kernels (triton_mla.py), each prefill chunk expanded in torch over the
reference backend's metadata. On the CPU, MLA runs over the reference backend alone.

The decode part of a step's metadata can be built from device buffers (`decode_metadata`), so
a CUDA graph captures an MLA model's decode steps as it does a dense model's
(worker/cuda_graphs.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.layers.attention.base import StepInputs, host_to_device
from pagedllm.layers.attention.torch_ref import TorchAttentionBackend, TorchAttentionMetadata
from pagedllm.layers.attention.triton_backend import TritonAttentionBackend
from pagedllm.layers.attention.triton_launch import KernelConfig, num_decode_splits

HEADS_PER_PROGRAM = 16  # triton_launch.mla_launch's block_m: the split heuristic's programs


@dataclass
class MlaTritonMetadata:
    slot_mapping: torch.Tensor  # (N,) int64, < 0 = padding (not written)
    num_decodes: int
    block_tables: torch.Tensor  # (D, max_blocks) int32, the decodes' block tables
    context_lens: torch.Tensor  # (D,) int32, 0 = padding (output 0)
    max_decode_context: int  # longest decode context (host-known), for the split heuristic
    num_splits: int | None  # decode split-K fixed by a graph; None: chosen per step
    prefill: TorchAttentionMetadata | None  # the prefill chunks (None: a step of decodes)
    config: KernelConfig

    def write_and_decode(
        self, new: torch.Tensor, query: torch.Tensor, cache: torch.Tensor, rank: int, scale: float
    ) -> torch.Tensor:
        """Writes the step's cache rows `new` (N, rank + rope) into `cache`, then attends the
        decodes' queries `query` (D, heads, rank + rope) [q_lat | q_rope] over their rows:
        (D, heads, rank)."""
        from pagedllm.layers.attention import triton_mla

        triton_mla.write_latent(new, cache, self.slot_mapping)
        return triton_mla.mla_decode(
            query,
            cache,
            self.block_tables,
            self.context_lens,
            rank,
            scale,
            self.splits(query.shape[1]),
            self.config,
        )

    def splits(self, num_heads: int) -> int:
        """The decodes' split-K: the graph's, else the heuristic over (request, head group)
        programs."""
        if self.num_splits is not None:
            return self.num_splits
        groups = head_groups(num_heads)
        return num_decode_splits(self.num_decodes, groups, self.max_decode_context, self.config)


class MlaTritonBackend(TritonAttentionBackend):
    """The Triton backend's kernel configuration (the device's SM count) and MLA's metadata;
    model/mla.py's `mla_forward` does the attention itself (the executor sets the cache's
    shape: (blocks, block_size, rank + rope))."""

    name = "triton-mla"

    def __init__(self) -> None:
        super().__init__()
        self.prefill_backend = TorchAttentionBackend()

    def build_metadata(self, step: StepInputs) -> MlaTritonMetadata:  # type: ignore[override]
        device, d = step.input_ids.device, step.num_decodes
        prefill = None
        if d < len(step.context_lens):
            prefill = self.prefill_backend.build_metadata(step)
        return MlaTritonMetadata(
            slot_mapping=step.slot_mapping,
            num_decodes=d,
            block_tables=step.block_tables[:d].to(torch.int32),
            context_lens=host_to_device(step.context_lens[:d], device, torch.int32),
            max_decode_context=max(step.context_lens[:d], default=0),
            num_splits=None,
            prefill=prefill,
            config=self.kernel_config(device),
        )

    def decode_metadata(  # type: ignore[override]
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        num_splits: int,
    ) -> MlaTritonMetadata:
        """A decode-only step over device buffers: no host list, no copy (a CUDA graph)."""
        n, cfg = context_lens.shape[0], self.kernel_config(context_lens.device)
        return MlaTritonMetadata(
            slot_mapping, n, block_tables, context_lens, 0, num_splits, None, cfg
        )


def head_groups(num_heads: int) -> int:
    """The decode kernel's programs per request: groups of `HEADS_PER_PROGRAM` query heads."""
    return -(-num_heads // HEADS_PER_PROGRAM)

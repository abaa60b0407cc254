"""CPU attention backend: the C++ paged decode kernel (cpu_kernels.py) for the decodes, the
pure-PyTorch reference backend for the cache write and the prefill chunks; over an int8 cache
(kv_cache_dtype.py) the C++ write and kernel for the prefill chunks too, each of their tokens
attended as a decode whose context ends at it (causal).

Falls back to the reference decode path, with the same results up to rounding, when the
kernel cannot be built or does not handle the shapes (see `cpu_kernels.supports`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

import torch

from pagedllm.layers.attention import cpu_kernels
from pagedllm.layers.attention.base import AttnLayer, DecodeBatch, StepInputs
from pagedllm.layers.attention.torch_ref import TorchAttentionBackend, TorchAttentionMetadata


@dataclass
class CpuAttentionMetadata:
    step: StepInputs
    num_decodes: int
    block_tables: torch.Tensor  # (D, max_blocks) int64
    context_lens: torch.Tensor  # (D,) int64
    builder: TorchAttentionBackend = field(repr=False)

    # The reference path's metadata, built when first used: a step of decodes that the
    # kernels run whole (csrc/decoder.cpp) never needs its masks (six tensor ops a step).
    @cached_property
    def ref(self) -> TorchAttentionMetadata:
        """The whole step, for the reference path."""
        return self.builder.build_metadata(self.step)

    @cached_property
    def prefill_ref(self) -> TorchAttentionMetadata:
        """The same without the decodes."""
        return dataclasses.replace(self.ref, num_decodes=0)

    @cached_property
    def per_token(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token of the step as a decode: its request's block-table row (N, max_blocks)
        and its context length, the keys up to and including its own (N,)."""
        s = self.step
        q_lens = torch.tensor(s.query_start_loc).diff()
        req = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
        ends = torch.tensor(s.query_start_loc[1:])[req]  # one past each token's request
        lens = torch.tensor(s.context_lens)[req] - (ends - 1 - torch.arange(len(req)))
        return s.block_tables.index_select(0, req), lens


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self) -> None:
        self._ref = TorchAttentionBackend()
        self.kernel_available = cpu_kernels.kernel_available()  # builds it on first use

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return self._ref.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def build_metadata(self, step: StepInputs) -> CpuAttentionMetadata:
        d = step.num_decodes
        return CpuAttentionMetadata(
            step=step,
            num_decodes=d,
            block_tables=step.block_tables[:d],  # int64, rows contiguous (StepInputs)
            context_lens=torch.tensor(step.context_lens[:d], dtype=torch.int64),
            builder=self._ref,
        )

    def decode_batch(self, metadata: CpuAttentionMetadata) -> DecodeBatch | None:
        m = metadata
        if not self.kernel_available or m.num_decodes != len(m.step.slot_mapping):
            return None
        return DecodeBatch(m.step.slot_mapping, m.block_tables, m.context_lens)

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuAttentionMetadata,
        layer: AttnLayer,
    ) -> torch.Tensor:
        m, d = metadata, metadata.num_decodes
        int8 = kv_cache.dtype == torch.int8  # prefill chunks on the kernel too
        if (d == 0 and not int8) or not (
            self.kernel_available and cpu_kernels.supports(q, kv_cache)
        ):
            return self._ref.forward(q, kv, kv_cache, m.ref, layer)
        if d == q.shape[0] or int8:
            cpu_kernels.write_kv(kv, kv_cache, m.step.slot_mapping)
            tables, lens = (m.block_tables, m.context_lens) if d == q.shape[0] else m.per_token
            return self._decode(q, kv_cache, tables, lens, layer)
        # writes every new key/value (the decodes' too) before attending the prefill chunks
        prefill_out = self._ref.forward(q, kv, kv_cache, m.prefill_ref, layer)
        decode_out = self._decode(q[:d], kv_cache, m.block_tables, m.context_lens, layer)
        return torch.cat([decode_out, prefill_out])

    @staticmethod
    def _decode(
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        layer: AttnLayer,
    ) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype)
        return cpu_kernels.paged_decode_attention(
            out,
            q,
            kv_cache,
            block_tables,
            context_lens,
            layer.scale,
            layer.window,
            layer.softcap,
            layer.sinks,
        )

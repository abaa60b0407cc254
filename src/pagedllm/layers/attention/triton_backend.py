"""Attention backend over the Triton-language kernels (triton_kernels.py): the GPU path.

Cache layout per layer: (num_blocks, 2, num_kv_heads, block_size, head_dim), head-major, so the
keys (or values) of one block for one KV head are one contiguous block_size x head_dim tile
(a 4 KiB read for 16 x 128 fp16). The kernels take strides, so they also run on a permuted view
of the reference layout; the tests use that to compare both backends on the same cache.

Per-step metadata is built from the step's host lists (query starts, context lengths) and
copied to the device without a synchronization (pinned memory, non-blocking); the decode path
can also be built straight from device buffers (`decode_metadata`), which is what a CUDA graph
captures. It holds nothing of a layer: each layer's window, soft-cap, sinks and scale
(`AttnLayer`) come with its `forward` call and select the kernels' variants per launch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pagedllm.layers.attention import triton_kernels, triton_prefill
from pagedllm.layers.attention.base import AttnLayer, StepInputs, host_to_device
from pagedllm.layers.attention.triton_launch import KernelConfig, num_decode_splits, prefill_tiles


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # (N,) int64, < 0 = padding (not written)
    block_tables: torch.Tensor  # (R, max_blocks) int32
    context_lens: torch.Tensor  # (R,) int32
    query_start_loc: torch.Tensor  # (R + 1,) int32
    num_decodes: int
    max_decode_context: int  # longest decode context (host-known), for the split heuristic
    num_splits: int | None  # decode split-K (a power of two); None: chosen per launch
    tile_request: torch.Tensor  # (T,) int32: prefill query tiles
    tile_row: torch.Tensor  # (T,) int32


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, config: KernelConfig | None = None) -> None:
        self.config = config or KernelConfig()
        self._sms_read = False

    def kernel_config(self, device: torch.device) -> KernelConfig:
        """On a GPU, the split heuristic uses its real multiprocessor count (read once)."""
        if device.type == "cuda" and not self._sms_read:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            self.config = dataclasses.replace(self.config, num_sms=sms)
            self._sms_read = True
        return self.config

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (num_blocks, 2, num_kv_heads, block_size, head_dim)

    def build_metadata(self, step: StepInputs) -> TritonAttentionMetadata:
        device = step.input_ids.device
        d, cfg = step.num_decodes, self.kernel_config(device)
        requests, rows = prefill_tiles(step.query_start_loc, d, cfg.prefill_block_m)
        i32 = torch.int32
        return TritonAttentionMetadata(
            slot_mapping=step.slot_mapping,
            block_tables=step.block_tables.to(i32),
            context_lens=host_to_device(step.context_lens, device, i32),
            query_start_loc=host_to_device(step.query_start_loc, device, i32),
            num_decodes=d,
            max_decode_context=max(step.context_lens[:d], default=0),
            num_splits=None,
            tile_request=host_to_device(requests, device, i32),
            tile_row=host_to_device(rows, device, i32),
        )

    def decode_metadata(
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        num_splits: int,
    ) -> TritonAttentionMetadata:
        """A decode-only step over device buffers (D rows each): no host list, no copy, so a
        CUDA graph can capture it; `num_splits` is fixed for the graph's lifetime."""
        empty = torch.zeros(0, dtype=torch.int32, device=context_lens.device)
        return TritonAttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            context_lens=context_lens,
            query_start_loc=empty,
            num_decodes=context_lens.shape[0],
            max_decode_context=0,
            num_splits=num_splits,
            tile_request=empty,
            tile_row=empty,
        )

    def decode_batch(self, metadata: TritonAttentionMetadata) -> None:
        return None  # no fused CPU decode

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        layer: AttnLayer,
    ) -> torch.Tensor:
        m, cfg = metadata, self.config
        scales = (layer.k_scale, layer.v_scale)
        triton_kernels.write_kv(kv, kv_cache, m.slot_mapping, scales)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        d = m.num_decodes
        if d:
            splits = self.decode_splits(m, kv.shape[2], layer.window)
            triton_kernels.paged_decode(
                out[:d],
                q[:d],
                kv_cache,
                m.block_tables,
                m.context_lens,
                layer.scale,
                splits,
                layer.window,
                cfg,
                layer.softcap,
                layer.sinks,
                scales,
            )
        if m.tile_request.shape[0]:
            triton_prefill.paged_prefill(
                out,
                q,
                kv_cache,
                m.block_tables,
                m.query_start_loc,
                m.context_lens,
                m.tile_request,
                m.tile_row,
                layer.scale,
                layer.window,
                cfg,
                layer.softcap,
                layer.sinks,
                scales,
            )
        return out

    def decode_splits(
        self, metadata: TritonAttentionMetadata, num_kv_heads: int, window: int | None
    ) -> int:
        """A layer's decode split-K: the step's (the count a graph fixed, or the heuristic over
        the longest decode context), capped for a windowed layer by the heuristic over its
        window, the most keys it reads per request. The heuristic grows with the context, so
        the cap is the heuristic over min(context, window) in both cases."""
        m, cfg = metadata, self.config
        splits = m.num_splits or num_decode_splits(
            m.num_decodes, num_kv_heads, m.max_decode_context, cfg
        )
        if window is not None:
            splits = min(splits, num_decode_splits(m.num_decodes, num_kv_heads, window, cfg))
        return splits

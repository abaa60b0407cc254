"""What every attention backend receives: one flattened batch per step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch


def host_to_device(values: Sequence[Any], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A host list (of lists) as a device tensor; on a GPU through pinned memory with a
    non-blocking copy, which does not wait for the GPU's queued work as a copy from pageable
    memory does (the pinned block is reused only after the copy completed: torch's caching
    host allocator records the copy's stream)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass
class StepInputs:
    """A step's batch, flattened: the first `num_decodes` requests have one new token each
    (decodes); the rest are prefill chunks. N = total new tokens, R = requests."""

    input_ids: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64
    slot_mapping: torch.Tensor  # (N,) int64: KV-cache slot (block * block_size + offset)
    query_start_loc: list[int]  # (R + 1,): request r's tokens are [loc[r], loc[r+1])
    context_lens: list[int]  # (R,): tokens in the cache after this step (prefix + new)
    block_tables: torch.Tensor  # (R, max_blocks) int64, padded with 0
    num_decodes: int
    logits_indices: torch.Tensor  # (S,) int64: tokens whose next token is sampled
    block_size: int


def split_qkv(qkv: torch.Tensor, h: int, kvh: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A backend's inputs as strided views of the (N, h + 2 * kvh, head_dim)
    projection: q (N, h, head_dim) and the new keys/values (N, 2, kvh, head_dim)."""
    return qkv[:, :h], qkv[:, h:].view(qkv.shape[0], 2, kvh, qkv.shape[2])


class AttnLayer(NamedTuple):
    """One layer's attention: the softmax scale, its sliding window (a query at position p
    sees keys (p - window, p]; None: all before it), the logit soft-cap (scores become
    cap * tanh(s / cap) after scaling; None: none) and the attention sinks (gpt-oss): one
    learned logit per query head that joins each query's softmax denominator and has no value,
    out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sinks[h])); fp32 (num_heads,) of this
    rank's heads, on the model's device; None: none. `k_scale` / `v_scale`: an fp8 cache's
    scales (vLLM's): keys stored as k / k_scale, read back as fp8 * k_scale (values alike);
    other caches ignore them."""

    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0


class DecodeBatch(NamedTuple):
    """A step of decodes only, as the C++ decode kernels take it (csrc/decoder.cpp)."""

    slot_mapping: torch.Tensor  # (D,) int64
    block_tables: torch.Tensor  # (D, max_blocks) int64, rows contiguous
    context_lens: torch.Tensor  # (D,) int64: tokens in the cache, the new one included


class AttentionBackend(Protocol):
    """Owns the KV-cache layout: writes the new keys/values into their slots, then attends
    over each request's cached context."""

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV cache (keys and values together)."""
        ...

    def build_metadata(self, step: StepInputs) -> Any:
        """Per-step tensors shared by every layer (built once per step)."""
        ...

    def decode_batch(self, metadata: Any) -> DecodeBatch | None:
        """The step as a `DecodeBatch` when all its tokens are decodes and this backend's
        attention is the C++ CPU kernel (the model may then run its layers in one call); else
        None."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # (N, num_heads, head_dim)
        kv: torch.Tensor,  # (N, 2, num_kv_heads, head_dim): the new keys and values
        kv_cache: torch.Tensor,  # kv_cache_shape(...)
        metadata: Any,
        layer: AttnLayer,
    ) -> torch.Tensor:  # (N, num_heads, head_dim)
        ...

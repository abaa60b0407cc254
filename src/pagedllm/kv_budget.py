"""How many KV-cache blocks an engine gets: from a memory budget on the CPU, from the free
device memory on a GPU (after weights and an activation reserve). With tensor parallelism
every rank holds its share of the weights and of the KV heads, and the budget is per rank
(per device; on the CPU, per process)."""

from __future__ import annotations

import gc
from typing import Protocol

import torch

from pagedllm.errors import ConfigError
from pagedllm.kv_cache_dtype import bytes_per_token_layer


class ModelSizes(Protocol):
    """What sizing reads of a model's config (`config.ModelConfig`)."""

    @property
    def num_parameters(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def num_heads(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def intermediate_size(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def kv_values_per_token(self, world: int = 1) -> int: ...

    @property
    def num_kv_layers(self) -> int: ...


# per rank, for NCCL's communicator buffers when the model is split over GPUs
NCCL_RESERVE = 512 << 20


def num_kv_blocks(
    model: ModelSizes,
    device: str,
    dtype: torch.dtype,
    quantization: str | None,
    block_size: int,
    model_len: int,
    max_num_seqs: int,
    batched_tokens: int,
    kv_cache_memory: int,
    gpu_memory_utilization: float,
    tensor_parallel_size: int = 1,
    sliding_window: int | None = None,
    reserved_bytes: int = 0,
    kv_cache_dtype: str = "auto",
    draft: ModelSizes | None = None,
) -> int:
    """Enough blocks for every sequence at full length, capped by the memory budget: on a CUDA
    device its free memory (`gpu_memory_utilization`), else `kv_cache_memory` bytes. With
    `sliding_window` (every layer's: blocks out of it are freed) a sequence holds at most its
    window before a chunk of `batched_tokens`, the chunk, and one block of misalignment.
    A quantized cache (`kv_cache_dtype`) counts its bytes per token, scales included.
    `reserved_bytes` of the budget go elsewhere (a hybrid model's state slots). A `draft`
    model (speculative decoding) keeps its KV in the same blocks: its layers' bytes are added
    to every block's, and its weights to the GPU's."""
    world = tensor_parallel_size
    if device.startswith("cuda"):
        # an engine closed in this process leaves its pool cached by torch: count it free
        gc.collect()
        torch.cuda.empty_cache()
        # every rank's pool has the same number of blocks: the GPU with the least free
        first = torch.device(device).index or 0
        free, total = min(torch.cuda.mem_get_info(first + rank) for rank in range(world))
        kv_cache_memory = device_kv_cache_budget(
            free,
            total,
            gpu_memory_utilization,
            weight_bytes=int(model.num_parameters * _bytes_per_weight(quantization, dtype) / world)
            + (0 if draft is None else draft.num_parameters * dtype.itemsize),
            activation_bytes=activation_reserve(model, batched_tokens, max_num_seqs)
            + (NCCL_RESERVE if world > 1 else 0),
        )
    per_seq = -(-model_len // block_size)
    if sliding_window is not None:
        per_seq = min(per_seq, -(-(sliding_window - 1 + batched_tokens) // block_size) + 1)
    # a rank's KV heads (replicated past them), or latent attention's one row
    values = model.kv_values_per_token(world)
    per_token = bytes_per_token_layer(kv_cache_dtype, dtype, values, model.head_dim)
    bytes_per_block = model.num_kv_layers * block_size * per_token
    if draft is not None:  # unsharded: the draft runs on rank 0 alone
        draft_token = bytes_per_token_layer(
            kv_cache_dtype, dtype, draft.kv_values_per_token(1), draft.head_dim
        )
        bytes_per_block += draft.num_kv_layers * block_size * draft_token
    usable = max(0, kv_cache_memory - reserved_bytes)  # the rest: a hybrid's state slots
    return max(1, min(per_seq * max_num_seqs, usable // bytes_per_block))


def _bytes_per_weight(quantization: str | None, dtype: torch.dtype) -> float:
    """An upper bound of the weights' bytes per parameter (int4: 4-bit values with fp16 scale
    and min per 32; a GGUF file holds at most 8-bit blocks, or 16-bit tensors)."""
    return {None: dtype.itemsize, "int8": 1.125, "int4": 1.125, "gguf": dtype.itemsize}[
        quantization
    ]


def device_kv_cache_budget(
    free: int, total: int, utilization: float, weight_bytes: int, activation_bytes: int
) -> int:
    """Bytes of the KV pool on a GPU, measured before the model is loaded: the engine's share
    of the device (`total * utilization`) less what is already in use (other processes, the
    CUDA context: `total - free`), the weights and the activation reserve."""
    budget = int(total * utilization) - (total - free) - weight_bytes - activation_bytes
    if budget <= 0:
        gib = 1 << 30
        raise ConfigError(
            f"no device memory left for the KV cache: {utilization:.0%} of {total / gib:.1f} "
            f"GiB, {(total - free) / gib:.1f} GiB already used, weights "
            f"{weight_bytes / gib:.1f} GiB, activations {activation_bytes / gib:.1f} GiB; "
            "raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return budget


def activation_reserve(model: ModelSizes, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """A conservative estimate of the peak memory of one step besides weights and KV cache:
    per token the fused qkv and gate/up outputs and a few hidden-size buffers (fp32 upper
    bound, twice for the allocator's slack), fp32 logits and sampler copies of every
    sequence, and 512 MiB for CUDA graphs' pool, kernel workspaces and fragmentation."""
    qkv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    per_token = (qkv + 2 * model.intermediate_size + 4 * model.hidden_size) * 4 * 2
    logits = max_num_seqs * model.vocab_size * 4 * 4
    return max_num_batched_tokens * per_token + logits + (512 << 20)

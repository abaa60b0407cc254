"""Frozen configuration dataclasses: the engine, the KV cache and the scheduler (the model's,
read from a HF `config.json`, is in model_config.py). "auto" values are resolved before freezing."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedllm import hybrid_config, kv_budget, kv_cache_dtype
from pagedllm.device import DEVICES, RESOLVED, check_device, resolve_device
from pagedllm.draft_config import draft_model_config
from pagedllm.errors import ConfigError
from pagedllm.families import SUPPORTED_ARCHITECTURES
from pagedllm.kv_cache_dtype import check_kv_cache_dtype, check_supported
from pagedllm.lora import pool as lora_pool
from pagedllm.lora.request import LoRAConfig
from pagedllm.model_config import ModelConfig, RopeConfig
from pagedllm.spec_config import SpeculativeConfig

__all__ = [  # re-exported
    "DEVICES",
    "SUPPORTED_ARCHITECTURES",
    "ConfigError",
    "ModelConfig",
    "RopeConfig",
    "check_device",
    "resolve_device",
]

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None) -> torch.dtype:
    """`auto` takes the checkpoint's dtype (float32 when it names none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = (checkpoint_dtype or "float32") if dtype == "auto" else dtype
    name = name.removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # None: size the pool to hold `max_num_seqs` requests of the full context length
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    # the window of EVERY layer (the widest): a request's blocks out of it are freed as it
    # goes; None (some layer attends globally, or off) keeps them until the request ends
    sliding_window: int | None = None
    # a hybrid model's linear-attention state slots (core/state_pool.py); None: no such layers
    num_state_slots: int | None = None
    # the KV cache's element type (kv_cache_dtype.py): auto, fp8_e4m3, fp8_e5m2 or int8
    cache_dtype: str = "auto"
    # an fp8 cache without scales in the checkpoint: estimate them from the first forward
    # (vLLM's calculate_kv_scales; model/kv_scales.py); else 1.0
    calculate_kv_scales: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_dtype", check_kv_cache_dtype(self.cache_dtype))
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @staticmethod
    def window_of(layer_windows: tuple[int | None, ...]) -> int | None:
        """The window blocks may be freed by: the widest when every layer has one. All layers
        share one block table, so with any global layer (Gemma 2 and 3) none is (per-layer-
        group tables, as vLLM's hybrid allocator keeps, would be the next step)."""
        windows = [w for w in layer_windows if w is not None]
        return max(windows) if windows and len(windows) == len(layer_windows) else None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # adapters running at once (LoRAConfig.max_loras); 0: LoRA off
    max_loras: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "without chunked prefill max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )


def kv_bytes_per_token(model: ModelConfig, kind: str, dtype: torch.dtype, world: int = 1) -> int:
    """The KV cache's bytes per token on a rank (scales included): what the engine reports as
    `kv_bytes_per_token` (MLA: the latent and rotated key; a hybrid's linear layers: none)."""
    values = model.kv_values_per_token(world)
    return model.num_kv_layers * kv_cache_dtype.bytes_per_token_layer(
        kind, dtype, values, model.head_dim
    )


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    model: ModelConfig
    dtype: torch.dtype
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # "cpu" or "cuda:N": "auto" (and "cuda") are resolved before the config is frozen
    device: str = "auto"
    attention_backend: str = "auto"
    # on a GPU: the share of the device's memory this engine may use (weights, activations,
    # KV pool); and whether to run decode steps eagerly instead of through CUDA graphs
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    # weight-only quantization (layers/quant.py): None, "int8", "int4" or "gguf" (the model
    # directory's GGUF file, its quantized tensors kept as they are)
    quantization: str | None = None
    # ranks the model is split over (worker.tp_worker): the first on `device`, the others on
    # the next GPUs (or all on the CPU)
    tensor_parallel_size: int = 1
    # streamed (DELTA) outputs: one per this many new tokens of a sample, besides its first
    # and its last (vLLM's stream_interval): fewer, larger responses for less per-response work
    stream_interval: int = 1
    # LoRA adapters (pagedllm.lora); None: off
    lora: LoRAConfig | None = None
    # speculative decoding (spec_config.py), None for none
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ConfigError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not RESOLVED.fullmatch(self.device):  # never "auto" downstream
            object.__setattr__(self, "device", resolve_device(self.device))
        object.__setattr__(self, "quantization", check_quantization(self.quantization))
        check_utilization(self.gpu_memory_utilization)

    def kv_cache_report(self) -> kv_cache_dtype.KVCacheReport:
        """The KV cache's element type, bytes per token (scales included) and token capacity,
        as `EngineStats` names them."""
        kind = self.cache.cache_dtype
        per_token = kv_bytes_per_token(self.model, kind, self.dtype, self.tensor_parallel_size)
        return kv_cache_dtype.KVCacheReport(
            kv_cache_dtype=kv_cache_dtype.dtype_name(kind, self.dtype),
            kv_bytes_per_token=per_token,
            kv_token_capacity=(self.cache.num_kv_blocks or 0) * self.cache.block_size,
        )

    def kv_capacity_line(self) -> str:
        """One log line: the pool's blocks, tokens, element type and bytes."""
        r = self.kv_cache_report()
        blocks = self.cache.num_kv_blocks or 0
        total = r["kv_bytes_per_token"] * r["kv_token_capacity"]
        return (
            f"KV cache: {blocks} blocks of {self.cache.block_size} = {r['kv_token_capacity']} "
            f"tokens, {r['kv_cache_dtype']}, {r['kv_bytes_per_token']} bytes/token, "
            f"{total / (1 << 20):.1f} MiB per rank"
        )

    @staticmethod
    def create(
        model_dir: str | Path,
        *,
        dtype: str | torch.dtype = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        enable_chunked_prefill: bool = True,
        kv_cache_memory: int = 2 << 30,
        device: str = "auto",
        attention_backend: str = "auto",
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        quantization: str | None = None,
        tensor_parallel_size: int = 1,
        stream_interval: int = 1,
        free_out_of_window_blocks: bool = True,
        num_state_slots: int | None = None,
        kv_cache_dtype: str = "auto",
        calculate_kv_scales: bool = False,
        lora: LoRAConfig | None = None,
        speculative_config: dict[str, Any] | str | SpeculativeConfig | None = None,
    ) -> EngineConfig:
        """Build and validate the engine's configuration from user-facing knobs. `device`:
        one of DEVICES, resolved here (`resolve_device`). On a CUDA device the KV pool's memory
        comes from the device's free memory (`gpu_memory_utilization`), not from
        `kv_cache_memory`. `quantization`: QUANTIZATIONS, or None / "none" for the checkpoint's
        weights in `dtype`. `free_out_of_window_blocks`: on a model whose every layer has a
        sliding window, free a request's blocks once they fall out of it. `kv_cache_dtype`:
        vLLM's values (kv_cache_dtype.KV_CACHE_DTYPES), refused here where the device cannot
        run it. `lora`: serve LoRA adapters (docs/lora.md)."""
        device = resolve_device(device)
        kv_kind = check_kv_cache_dtype(kv_cache_dtype)
        quantization = check_quantization(quantization)
        check_utilization(gpu_memory_utilization)  # before it sizes a GPU's KV pool
        model = ModelConfig.from_model_dir(model_dir)
        check_supported(kv_kind, device, latent=model.mla is not None)
        context = model.context_length
        model_len = max_model_len or context
        if model_len > context:
            raise ConfigError(f"max_model_len {model_len} exceeds the model's context ({context})")
        torch_dtype = resolve_dtype(dtype, model.checkpoint_dtype)
        batched_tokens = max_num_batched_tokens or max(2048, min(model_len, 8192))
        speculative = SpeculativeConfig.from_dict(speculative_config)
        if speculative is not None and model.hybrid is not None:  # no state to roll back
            raise ConfigError("speculative decoding is not supported on hybrid (Qwen3.5) models")
        # a draft model's KV lies in the same blocks (draft_config.py): none freed by a window
        draft = draft_model_config(speculative, model, model_dir)
        free_out_of_window_blocks &= draft is None
        window = CacheConfig.window_of(model.layer_windows) if free_out_of_window_blocks else None
        state_bytes = 0
        if model.hybrid is not None:  # linear-attention state slots beside the KV pool
            budget = None if device.startswith("cuda") else kv_cache_memory
            num_state_slots, state_bytes = hybrid_config.size_state_pool(
                model.hybrid, num_state_slots, max_num_seqs, budget, torch_dtype.itemsize
            )
            enable_prefix_caching = hybrid_config.prefix_caching(
                enable_prefix_caching, model.architecture
            )
        if num_kv_blocks is None:
            gpu = device.startswith("cuda")  # there the adapters' slot pool is set aside too
            num_kv_blocks = kv_budget.num_kv_blocks(
                model,
                device,
                torch_dtype,
                quantization,
                block_size,
                model_len,
                max_num_seqs,
                batched_tokens,
                kv_cache_memory,
                gpu_memory_utilization,
                tensor_parallel_size,
                sliding_window=window,
                reserved_bytes=state_bytes
                + (lora_pool.reserve(model, lora, torch_dtype, tensor_parallel_size) if gpu else 0),
                kv_cache_dtype=kv_kind,
                draft=draft,
            )
        cache = CacheConfig(
            block_size,
            num_kv_blocks,
            enable_prefix_caching,
            window,
            num_state_slots,
            kv_kind,
            calculate_kv_scales,
        )
        sched = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=batched_tokens,
            max_model_len=model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            max_loras=0 if lora is None else lora.max_loras,
        )
        if lora is not None and (model.mla is not None or model.hybrid is not None):
            kind = "latent-attention (MLA)" if model.mla is not None else "hybrid (Qwen3.5)"
            raise ConfigError(f"LoRA adapters are not supported on {kind} models")
        return EngineConfig(
            model_dir=str(model_dir),
            model=model,
            dtype=torch_dtype,
            cache=cache,
            scheduler=sched,
            device=device,
            attention_backend=attention_backend,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            quantization=quantization,
            tensor_parallel_size=tensor_parallel_size,
            stream_interval=stream_interval,
            lora=lora,
            speculative=speculative,
        )


def check_utilization(value: float) -> None:
    if not 0 < value <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {value}")


QUANTIZATIONS = ("int8", "int4", "gguf")


def check_quantization(value: str | None) -> str | None:
    """None for no quantization ("none", "" and None), else one of QUANTIZATIONS."""
    name = (value or "none").strip().lower()
    if name == "none":
        return None
    if name not in QUANTIZATIONS:
        raise ConfigError(
            f"unsupported quantization {value!r}; use none, {', '.join(QUANTIZATIONS)}"
        )
    return name

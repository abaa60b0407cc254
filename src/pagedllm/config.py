"""Frozen configuration dataclasses: the model (read from a HF `config.json`), the KV cache
and the scheduler. "auto" values are resolved before freezing."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedllm import kv_budget
from pagedllm.device import DEVICES, RESOLVED, check_device, resolve_device
from pagedllm.errors import ConfigError

__all__ = ["DEVICES", "ConfigError", "check_device", "resolve_device"]  # re-exported

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

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
class RopeConfig:
    theta: float = 10000.0
    # "default", "linear", "dynamic" or "llama3"
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    @staticmethod
    def from_hf(hf: dict[str, Any]) -> RopeConfig:
        # transformers >= 5 writes `rope_parameters` (theta inside); 4.x writes `rope_theta` and
        # an optional `rope_scaling` dict whose type key is `rope_type` or the older `type`.
        params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", "linear", "dynamic", "llama3"):
            raise ConfigError(f"unsupported rope scaling type {rope_type!r}")
        return RopeConfig(
            theta=float(theta),
            type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=params.get("original_max_position_embeddings"),
        )


@dataclass(frozen=True)
class ModelConfig:
    """The parts of a HF `config.json` our Llama-family modules need."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    checkpoint_dtype: str | None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def num_parameters(self) -> int:
        """Parameters of the Llama-family model this config describes (embeddings counted
        once when tied)."""
        h, hd, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0)
        attn += h if self.o_bias else 0
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + h

    @property
    def context_length(self) -> int:
        """`linear` and `dynamic` rope scaling stretch the trained context by their factor."""
        if self.rope.type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * self.rope.factor)
        return self.max_position_embeddings

    @staticmethod
    def from_model_dir(model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        if not path.is_dir():
            raise ConfigError(f"model directory {str(path)!r} does not exist")
        hf = _read_json(path / "config.json")
        gen_path = path / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.exists() else {}
        return ModelConfig.from_hf(hf, gen)

    @staticmethod
    def from_hf(hf: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported activation {hf['hidden_act']!r} (only silu)")
        num_heads = hf["num_attention_heads"]
        is_qwen2 = arch == "Qwen2ForCausalLM"
        window = hf.get("sliding_window")
        if is_qwen2 and not hf.get("use_sliding_window", False):
            window = None
        eos = _ids((generation or {}).get("eos_token_id")) or _ids(hf.get("eos_token_id"))
        return ModelConfig(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rope=RopeConfig.from_hf(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or bool(hf.get("attention_bias", False)),
            o_bias=not is_qwen2 and bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=window,
            checkpoint_dtype=hf.get("dtype") or hf.get("torch_dtype"),
            eos_token_ids=eos,
            bos_token_id=hf.get("bos_token_id"),
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # None: size the pool to hold `max_num_seqs` requests of the full context length
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

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

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ConfigError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not RESOLVED.fullmatch(self.device):  # never "auto" downstream
            object.__setattr__(self, "device", resolve_device(self.device))
        object.__setattr__(self, "quantization", check_quantization(self.quantization))
        check_utilization(self.gpu_memory_utilization)

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
    ) -> EngineConfig:
        """Build and validate the engine's configuration from user-facing knobs. `device`:
        one of DEVICES, resolved here (`resolve_device`). On a CUDA device the KV pool's memory
        comes from the device's free memory (`gpu_memory_utilization`), not from
        `kv_cache_memory`. `quantization`: QUANTIZATIONS, or None / "none" for the checkpoint's
        weights in `dtype`."""
        device = resolve_device(device)
        quantization = check_quantization(quantization)
        check_utilization(gpu_memory_utilization)  # before it sizes a GPU's KV pool
        model = ModelConfig.from_model_dir(model_dir)
        context = model.context_length
        model_len = max_model_len or context
        if model_len > context:
            raise ConfigError(f"max_model_len {model_len} exceeds the model's context ({context})")
        torch_dtype = resolve_dtype(dtype, model.checkpoint_dtype)
        batched_tokens = max_num_batched_tokens or max(2048, min(model_len, 8192))
        if num_kv_blocks is None:
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
            )
        cache = CacheConfig(block_size, num_kv_blocks, enable_prefix_caching)
        sched = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=batched_tokens,
            max_model_len=model_len,
            enable_chunked_prefill=enable_chunked_prefill,
        )
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


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"missing {path.name} in {str(path.parent)!r}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)

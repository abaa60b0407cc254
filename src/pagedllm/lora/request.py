"""What names an adapter (vLLM's `LoRARequest`) and the engine's LoRA knobs."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pagedllm.errors import ConfigError

# vLLM's opt-in to loading and unloading adapters while serving ("1" or "true", any case): the
# OpenAI gateway's routes exist, and the engine obeys them, only where it is set
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# TensorRT-LLM's LoRA inputs (serving/lora_tasks.py); here, where the text models that forward
# them can import them without torch
TASK_INPUTS = ("lora_task_id", "lora_weights", "lora_config")


def runtime_updating_allowed() -> bool:
    return os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoRARequest:
    """An adapter, as vLLM names one: `lora_name` (what clients call it), `lora_int_id` (a
    positive id, unique per adapter: the slot pool, the host cache and the prefix cache key on
    it) and `lora_path`, a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def cache_salt(self) -> bytes:
        """The root of a request's chained block hashes: the same prompt under two adapters
        (or under one and the base model) never shares KV blocks."""
        return f"lora:{self.lora_int_id}".encode()


@dataclass(frozen=True)
class LoRAConfig:
    """`max_loras`: adapters resident on the device at once (a step's requests use at most
    these; others wait for a slot); `max_lora_rank`: the largest rank accepted;
    `max_cpu_loras`: adapters kept read in host memory (None: `max_loras`)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ConfigError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def cpu_capacity(self) -> int:
        assert self.max_cpu_loras is not None
        return self.max_cpu_loras

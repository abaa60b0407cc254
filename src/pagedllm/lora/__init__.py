"""LoRA adapters on the base model (docs/lora.md): PEFT adapter folders read and checked
(`adapter.py`), a device-resident pool of `max_loras` slots swapped LRU from a host cache of
`max_cpu_loras` (`slots.py`), and every adapter of a step applied as one batched computation,
tokens grouped by slot (`ops.py`)."""

from __future__ import annotations

from pagedllm.lora.request import LoRAConfig, LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]

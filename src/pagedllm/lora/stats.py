"""What vLLM's `vllm:lora_requests_info` gauge says: the adapters of the running and of the
waiting requests, and `max_loras` (serving/metrics.py exports it)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.lora.request import LoRAConfig
    from pagedllm.request import Request


@dataclass(frozen=True)
class LoRARequestsInfo:
    running: tuple[str, ...]  # the adapter names of running requests, sorted, each once
    waiting: tuple[str, ...]  # those of waiting requests (a slot, KV blocks or a turn)
    max_loras: int


def _names(requests: Iterable[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora_request.lora_name for r in requests if r.lora_request}))


def lora_requests_info(
    running: Iterable[Request], waiting: Iterable[Request], config: LoRAConfig | None
) -> LoRARequestsInfo | None:
    """None when LoRA is off (vLLM has no such gauge then)."""
    if config is None:
        return None
    return LoRARequestsInfo(_names(running), _names(waiting), config.max_loras)

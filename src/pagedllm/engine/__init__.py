from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine"]


def __getattr__(name: str) -> Any:
    """LLMEngine on first use: the engine's metrics names (engine.metrics) are read by
    serving modules that must not import torch (pagedllm/__init__.py)."""
    if name != "LLMEngine":
        raise AttributeError(f"module 'pagedllm.engine' has no attribute {name!r}")
    from pagedllm.engine.llm_engine import LLMEngine

    return LLMEngine

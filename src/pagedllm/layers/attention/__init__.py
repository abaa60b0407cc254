"""Paged-attention backends behind a small registry. GPU backends are imported lazily, so
`import pagedllm` never needs CUDA."""

from __future__ import annotations

import importlib

from pagedllm.layers.attention.base import AttentionBackend, StepInputs

# name -> "module:Class", imported on first use
_BACKENDS = {
    "torch": "pagedllm.layers.attention.torch_ref:TorchAttentionBackend",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def create_attention_backend(name: str, device: str = "cpu") -> AttentionBackend:
    """`auto` picks the pure-PyTorch backend on the CPU."""
    if name == "auto":
        name = "torch"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {available_backends()}")
    module_name, cls_name = _BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    backend: AttentionBackend = cls()
    return backend


__all__ = ["AttentionBackend", "StepInputs", "available_backends", "create_attention_backend"]

"""Paged-attention backends behind a small registry. GPU backends are imported lazily, so
`import pagedllm` never needs CUDA."""

from __future__ import annotations

import importlib

from pagedllm.layers.attention.base import AttentionBackend, StepInputs

# name -> "module:Class", imported on first use
_BACKENDS = {
    "torch": "pagedllm.layers.attention.torch_ref:TorchAttentionBackend",
    "cpu": "pagedllm.layers.attention.cpu_backend:CpuAttentionBackend",
    # Triton-language kernels: the GPU path (needs the `triton` package)
    "triton": "pagedllm.layers.attention.triton_backend:TritonAttentionBackend",
    # latent attention's (model/mla.py) on a GPU: the executor picks it for an MLA model
    "triton-mla": "pagedllm.layers.attention.mla_backend:MlaTritonBackend",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def create_attention_backend(name: str, device: str = "cpu") -> AttentionBackend:
    """`auto` picks the Triton kernels on a CUDA device; on the CPU, the C++ decode kernel when
    it builds here (compiled once per machine, ~40 s, then cached), else the pure-PyTorch
    backend. `device`: a resolved one (`pagedllm.config.resolve_device`), never "auto"."""
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"attention backends run on cpu or cuda, not {device!r}")
    if name == "auto" and device.startswith("cuda"):
        name = "triton"
    elif name == "auto":
        from pagedllm.layers.attention import cpu_kernels

        on_cpu = device == "cpu"
        name = "cpu" if on_cpu and cpu_kernels.kernel_available() else "torch"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {available_backends()}")
    module_name, cls_name = _BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    backend: AttentionBackend = cls()
    return backend


__all__ = ["AttentionBackend", "StepInputs", "available_backends", "create_attention_backend"]

"""Every kernel workload the compile check records and the GPU check runs, in the compile
table's order: attention and the bitmask (kernel_workloads.py), then the fused MoE,
Gated-DeltaNet, latent attention and LoRA kernels' own workloads, which build on
kernel_workloads' steps (so it does not import them)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from pagedllm.layers.gdn_workloads import gdn_workloads
from pagedllm.layers.kernel_workloads import attention_workloads
from pagedllm.layers.mla_workloads import mla_workloads
from pagedllm.layers.moe_workloads import moe_workloads
from pagedllm.lora.workloads import lora_workloads


def workloads(device: str = "cpu") -> Iterator[tuple[str, Callable[[], None]]]:
    """(label, a function making the workload's launches on `device`)."""
    yield from attention_workloads(device)
    yield from moe_workloads(device)
    yield from gdn_workloads(device)
    yield from mla_workloads(device)
    yield from lora_workloads(device)

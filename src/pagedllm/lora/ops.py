"""A step's LoRA deltas, every adapter at once: out[n] += B[s_n] @ (A[s_n] @ x[n]) for each token
n whose request uses the adapter in slot s_n (-1: the base model, nothing added).

The tokens are grouped by slot once per step (punica's SGMV: a segment of rows per adapter,
one shrink and one expand matmul per segment), so a layer's module costs at most one matmul
pair per adapter present in the step, whatever the number of requests; a slot whose tokens
lie in one contiguous run (a single request, or requests of one adapter side by side) is a
slice, not a gather. On the CPU one C++ call does a module's every token instead
(csrc/lora.cpp, the same grouping in C++: each slot's A and B read once for all its tokens,
threads over the slots' rows of A and B), on a GPU two Triton launches (lora/triton_ops.py); the grouped torch path is the
fallback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.layers.attention import cpu_kernels

Rows = slice | torch.Tensor
# a layer's modules, in csrc/decoder.cpp's LoraModule order
MODULES = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class LoraStep:
    """What a forward pass needs: the pool's weights, each slot's rows of the flat batch and
    the modules no adapter of the step adapts (skipped)."""

    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    groups: list[tuple[int, Rows]]
    skip: frozenset[str]
    token_slots: torch.Tensor  # (N,) int64, -1: the base model
    kernel: Any  # the C++ extension (a CPU step), else None
    # module -> the first output row of each projection fused in it (B block-diagonal: the
    # C++ kernel reads only each part's block); absent: one part
    parts: dict[str, list[int]]
    # every token through the two Triton launches, on any device: a CUDA graph's step
    # (lora/slots.py `graph_step`: slots from a buffer, no groups, no module skipped)
    triton: bool = False

    @staticmethod
    def create(
        weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]],
        token_slots: list[int],
        adapts: dict[str, list[bool]],
        device: torch.device,
        parts: dict[str, list[int]] | None = None,
    ) -> LoraStep:
        rows: dict[int, list[int]] = {}
        for n, slot in enumerate(token_slots):
            if slot >= 0:
                rows.setdefault(slot, []).append(n)
        groups: list[tuple[int, Rows]] = []
        for slot, idx in rows.items():
            if idx[-1] - idx[0] + 1 == len(idx):
                groups.append((slot, slice(idx[0], idx[-1] + 1)))
            else:
                groups.append((slot, torch.tensor(idx, dtype=torch.int64, device=device)))
        skip = frozenset(m for m, flags in adapts.items() if not any(flags[s] for s in rows))
        slots = torch.tensor(token_slots, dtype=torch.int64, device=device)
        kernel = cpu_kernels.kernel_module() if device.type == "cpu" else None
        return LoraStep(weights, groups, skip, slots, kernel, parts or {})

    def kernel_args(self, dtype: torch.dtype) -> tuple[Any, ...] | None:
        """The step as csrc/decoder.cpp's `decode_layers` takes it: per layer, (A, B) of each
        of MODULES (empty tensors for a module skipped, or absent: an MoE layer's MLP), the
        tokens' slots and each module's parts; None where its lora_bgmv would refuse them (not
        the CPU's extension, weights of another dtype): the layers then run op by op."""
        if self.kernel is None:
            return None
        none = torch.empty(0, dtype=dtype)
        flat: list[torch.Tensor] = []
        for layer in self.weights:
            for module in MODULES:
                pair = None if module in self.skip else layer.get(module)
                if pair is None:
                    flat += (none, none)
                elif all(t.dtype == dtype and t.is_contiguous() for t in pair):
                    flat += pair
                else:
                    return None
        return flat, self.token_slots, [self.parts.get(m, []) for m in MODULES]

    def add(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out (N, out) += the deltas of `module` of `layer` for x (N, in), in place."""
        if module in self.skip:
            return
        pair = self.weights[layer].get(module)
        if pair is None:
            return
        parts = self.parts.get(module, [])
        if self.kernel is not None and self.kernel.lora_bgmv(
            out, x, *pair, self.token_slots, parts
        ):
            return
        if out.is_cuda or self.triton:  # two Triton launches, every token (lora/triton_ops.py)
            from pagedllm.lora.triton_ops import lora_bgmv_triton

            lora_bgmv_triton(out, x, pair[0], pair[1], self.token_slots)
            return
        lora_grouped(out, x, pair[0], pair[1], self.groups)


def lora_grouped(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    groups: list[tuple[int, Rows]],
) -> None:
    """The torch path: per slot, its rows' shrink (x A^T) and expand (. B^T) added to out.
    a: (slots, R, in), b: (slots, out, R)."""
    for slot, rows in groups:
        delta = (x[rows] @ a[slot].t()) @ b[slot].t()
        if isinstance(rows, slice):
            out[rows] += delta
        else:
            out.index_add_(0, rows, delta)


def lora_reference(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """The oracle for the kernels: each token alone, in fp32. Returns the (N, out) deltas."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float32, device=x.device)
    for n, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            out[n] = b[slot].float() @ (a[slot].float() @ x[n].float())
    return out

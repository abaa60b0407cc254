"""The Gated-DeltaNet kernel workloads (layers/gated_delta_triton.py) that the compile check
records and the GPU check can run: the linear-attention layer of each Qwen3.5 / Qwen3-Next
shape we claim (HF config: linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
linear_value_head_dim, linear_conv_kernel_dim), in fp16, bf16 and fp32, over a mixed step
(decodes, a new prompt, a continued prefill chunk) and a decode step, slots out of order.

Zeros without a generator (recording: nothing runs); with one, random values, for the
comparison with the CPU path (`gated_delta.causal_conv1d` / `gated_delta_rule`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from pagedllm.layers.gated_delta import GdnShape, GdnState
from pagedllm.layers.gdn_meta import GdnMeta

GDN_SHAPES = {
    # Qwen3.5-0.8B / 2B: 16 key and 16 value heads of 128
    "Qwen3.5-0.8B": GdnShape(16, 16, 128, 128, 4),
    # Qwen3-Next-80B-A3B: 2 value heads per key head
    "Qwen3-Next-80B": GdnShape(16, 32, 128, 128, 4),
    # Qwen3.5-27B: 3 value heads per key head
    "Qwen3.5-27B": GdnShape(16, 48, 128, 128, 4),
}
GDN_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
SLOTS = 8
# (tokens, slot, continues its slot): decodes first, then a new prompt and a continued chunk
MIXED = ((1, 5, True), (1, 2, True), (40, 0, False), (100, 6, True))
DECODES = ((1, 3, True), (1, 7, True), (1, 1, True))


@dataclass
class GdnCase:
    """A step of one layer: the mixed projection (T, conv_dim), the conv weight, gating
    (T, Hv) fp32, the state pool and the step's metadata."""

    label: str
    shape: GdnShape
    mixed: torch.Tensor
    weight: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    state: GdnState
    meta: GdnMeta


def gdn_cases(
    shape: GdnShape,
    dtype: torch.dtype,
    device: str = "cpu",
    generator: torch.Generator | None = None,
    name: str = "",
) -> Iterator[GdnCase]:
    """The mixed step, then the decode step, each over a fresh state pool."""

    def values(*size: int, scale: float = 1.0) -> torch.Tensor:
        if generator is None:
            return torch.zeros(size, device=device)
        return torch.randn(size, device=device, generator=generator) * scale

    for kind, requests in (("mixed", MIXED), ("decode", DECODES)):
        starts = [0]
        for n, _, _ in requests:
            starts.append(starts[-1] + n)
        meta = GdnMeta.build(starts, [s for _, s, _ in requests], [c for *_, c in requests], device)
        t, hv = starts[-1], shape.value_heads
        state = shape.new_state(SLOTS, dtype, device)
        state.conv.copy_(values(*state.conv.shape))
        state.ssm.copy_(values(*state.ssm.shape, scale=0.1))
        g = -values(t, hv).abs() * 0.5  # log decays <= 0
        beta = values(t, hv).sigmoid()
        mixed = values(t, shape.conv_dim).to(dtype)
        weight = values(shape.conv_dim, shape.conv_kernel, scale=0.5).to(dtype)
        label = f"gdn {name} {_short(dtype)} {kind}"
        yield GdnCase(label, shape, mixed, weight, g, beta, state, meta)


def run_gdn_case(case: GdnCase) -> torch.Tensor:
    """The Triton path over the case: conv (updating the conv states), then the delta rule
    (updating the recurrent states); the output (T, Hv, Dv)."""
    from pagedllm.layers.gated_delta_triton import causal_conv1d_triton, gated_delta_triton

    state, meta = case.state, case.meta
    conv = causal_conv1d_triton(case.mixed, case.weight, None, state.conv, meta, "silu")
    q, k, v = case.shape.split(conv)
    return gated_delta_triton(q, k, v, case.g, case.beta, state.ssm, meta, True)


def _short(dtype: torch.dtype) -> str:
    return next(k for k, v in GDN_DTYPES.items() if v == dtype)


def gdn_workloads(device: str = "cpu") -> Iterator[tuple[str, Callable[[], None]]]:
    """(label, launches) per shape and dtype, as `all_workloads.workloads` yields them."""
    for model, shape in GDN_SHAPES.items():
        for dname, dtype in GDN_DTYPES.items():

            def run(
                model: str = model, shape: GdnShape = shape, dtype: torch.dtype = dtype
            ) -> None:
                for case in gdn_cases(shape, dtype, device, name=model):
                    run_gdn_case(case)

            group = shape.value_heads // shape.key_heads
            yield f"gdn {model} {dname} Hv{shape.value_heads} group{group}", run

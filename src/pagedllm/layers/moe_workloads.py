"""The fused-MoE kernel workloads (layers/moe_triton.py) that the compile check records and the
GPU check runs: the experts of each mixture-of-experts shape we claim, in fp16 and bf16 (and
fp32, as the parity runs use), over decode batches and a prefill chunk (the token counts pick
the M tiles: `moe_launch`).

Without a generator the weights are left uninitialized (`torch.empty`): recording reads
nothing, so a Mixtral-sized expert stack costs address space, not memory; on a GPU the launches
then run on whatever the memory holds (the compile-match test looks at what compiles, not at
values). With a generator, random values scaled to outputs ~1, for the comparison with
`experts_loop`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from pagedllm.layers.moe import Experts


@dataclass(frozen=True)
class MoeShape:
    """The experts of one layer of a model we claim: hidden size H, expert intermediate size
    I, experts E, experts per token k, biases, gated activation."""

    model: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    bias: bool = False
    activation: str = "silu"


MOE_SHAPES = (
    MoeShape("Mixtral-8x7B", 4096, 14336, 8, 2),
    MoeShape("Qwen3-30B-A3B", 2048, 768, 128, 8),
    MoeShape("gpt-oss-20b", 2880, 2880, 32, 4, bias=True, activation="swiglu_oai"),
)
# decode batches (1 and 64 tokens: the 16-row tiles) and a prefill chunk (32- or 64-row tiles)
TOKENS = (1, 64, 512)
MOE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class MoeCase:
    label: str
    x: torch.Tensor  # (N, H)
    topk_weights: torch.Tensor  # (N, k) fp32
    topk_ids: torch.Tensor  # (N, k) int64
    experts: Experts


def make_experts(
    shape: MoeShape,
    dtype: torch.dtype,
    device: str = "cpu",
    generator: torch.Generator | None = None,
) -> Experts:
    """The shape's stacked experts: uninitialized without a generator, else random with
    weights ~ 1/sqrt(fan-in) and biases ~0.1."""
    e, h, i = shape.experts, shape.hidden, shape.inter

    def values(*size: int, scale: float) -> torch.Tensor:
        if generator is None:
            return torch.empty(size, dtype=dtype, device=device)
        t = torch.randn(size, device=device, generator=generator, dtype=torch.float32)
        return (t * scale).to(dtype)

    b13 = values(e, 2 * i, scale=0.1) if shape.bias else None
    b2 = values(e, h, scale=0.1) if shape.bias else None
    w13, w2 = values(e, 2 * i, h, scale=h**-0.5), values(e, h, i, scale=i**-0.5)
    return Experts(w13, w2, b13, b2, shape.activation)


def routing(
    n: int, shape: MoeShape, device: str, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights (n, k) fp32, topk_ids (n, k) int64): k distinct experts per token, the
    router's softmax-then-top-k; without a generator, round-robin experts, equal weights."""
    k, e = shape.top_k, shape.experts
    if generator is None:
        ids = (torch.arange(n * k, device=device) % e).view(n, k)
        return torch.full((n, k), 1.0 / k, device=device), ids
    logits = torch.randn(n, e, device=device, generator=generator)
    weights, ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def moe_cases(
    shape: MoeShape,
    dtype: torch.dtype,
    device: str = "cpu",
    generator: torch.Generator | None = None,
) -> Iterator[MoeCase]:
    """One case per token count of `TOKENS`, over one stack of experts."""
    experts = make_experts(shape, dtype, device, generator)
    name = next(k for k, v in MOE_DTYPES.items() if v == dtype)
    for n in TOKENS:
        if generator is None:
            x = torch.zeros(n, shape.hidden, dtype=dtype, device=device)
        else:
            x = torch.randn(n, shape.hidden, device=device, generator=generator).to(dtype)
        weights, ids = routing(n, shape, device, generator)
        yield MoeCase(f"{shape.model} {name} moe N={n}", x, weights, ids, experts)


def run_moe_case(case: MoeCase) -> torch.Tensor:
    from pagedllm.layers.moe_triton import fused_experts_triton

    out = fused_experts_triton(case.x, case.topk_weights, case.topk_ids, case.experts)
    assert out is not None
    return out


def moe_workloads(device: str = "cpu") -> Iterator[tuple[str, Callable[[], None]]]:
    """(label, launches) per shape and dtype, as `all_workloads.workloads` yields them."""
    for shape in MOE_SHAPES:
        for dname, dtype in MOE_DTYPES.items():

            def run(shape: MoeShape = shape, dtype: torch.dtype = dtype) -> None:
                for case in moe_cases(shape, dtype, device):
                    run_moe_case(case)

            # "moe Mixtral-8x7B fp16 E8 k2 silu": not the model's name first (its attention's)
            label = f"moe {shape.model} {dname} E{shape.experts} k{shape.top_k}"
            yield f"{label} {shape.activation}" + (" bias" if shape.bias else ""), run

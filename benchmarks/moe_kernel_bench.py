"""The experts of one MoE layer on the CPU: the C++ kernel against the Python loop, printing JSON.

    .venv/bin/python benchmarks/moe_kernel_bench.py [--tokens 1,32] [--formats fp32,int8]

A Qwen3-MoE-like layer scaled to a small machine (hidden 1024, 256 per expert, 64 experts,
top-8 by default): for each weight format and number of tokens, the time per call of
`layers.moe_cpu.fused_experts_cpu` ("kernel", csrc/moe.cpp) and of `layers.moe.experts_loop`
("loop", one Python round per expert with tokens), as medians of interleaved runs, with the
kernel's weight bytes per second (the experts with tokens, each read once). Random routing,
so at 32 tokens nearly every expert has a few. Sequential, the process's threads (2 here),
load average recorded. Each call routes its tokens anew (as the layers of a decode step do),
so the experts' weights come from memory rather than from the cache.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from collections.abc import Callable

import torch
from gemv_bench import median_ms  # benchmarks/ is the script's directory

from pagedllm.layers import quant
from pagedllm.layers.moe import Experts, experts_loop
from pagedllm.layers.moe_cpu import fused_experts_cpu


def stacked(w: torch.Tensor, fmt: str) -> quant.Weight:
    """(E, N, K) fp32 weights in `fmt`, quantized expert by expert and stacked."""
    if fmt == "fp32":
        return w
    if fmt == "bf16":
        return w.bfloat16()
    parts = [quant.quantize(w[e], fmt) for e in range(w.shape[0])]
    mins = (
        None
        if parts[0].mins is None
        else torch.stack([p.mins for p in parts if p.mins is not None])
    )
    return quant.QuantizedWeight(
        parts[0].bits,
        torch.stack([p.qweight for p in parts]),
        torch.stack([p.scales for p in parts]),
        mins,
    )


def expert_bytes(w: quant.Weight) -> int:
    """Bytes of one expert's weight."""
    if isinstance(w, quant.QuantizedWeight):
        return w.nbytes // w.qweight.shape[0]
    return w[0].numel() * w.element_size()


Routing = tuple[torch.Tensor, torch.Tensor]


def routings(n: int, e: int, k: int, count: int) -> list[Routing]:
    """`count` random top-k routings of n tokens: (N, k) fp32 weights (summing to 1), ids."""
    out = []
    for _ in range(count):
        weights, ids = torch.softmax(torch.randn(n, e), -1).topk(k, -1)
        out.append((weights / weights.sum(-1, keepdim=True), ids))
    return out


def over_routings(
    fn: Callable[..., object], x: torch.Tensor, experts: Experts, r: list[Routing]
) -> Callable[[], object]:
    """fn(x, weights, ids, experts) called on the next routing each time (a decode step's
    experts change from call to call: their weights come from memory, not from the cache)."""
    turns = itertools.cycle(r)
    return lambda: fn(x, *next(turns), experts)


def measure(fmt: str, experts: Experts, n: int, args: argparse.Namespace) -> dict[str, object]:
    h, e, k = args.hidden, args.experts, args.top_k
    x = torch.randn(n, h).to(torch.bfloat16 if fmt == "bf16" else torch.float32)
    r = routings(n, e, k, args.reps + 1)
    out = fused_experts_cpu(x, *r[0], experts)
    assert out is not None, f"the kernel refused {fmt} at {n} tokens"
    ref = experts_loop(x, *r[0], experts).float()
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    with torch.inference_mode():
        kernel_ms, loop_ms = median_ms(
            [
                over_routings(fused_experts_cpu, x, experts, r),
                over_routings(experts_loop, x, experts, r),
            ],
            args.reps,
        )
    active = statistics.mean(len(torch.unique(ids)) for _, ids in r)
    per_expert = expert_bytes(experts.w13) + expert_bytes(experts.w2)
    return {
        "format": fmt,
        "tokens": n,
        "experts_with_tokens": round(active, 1),
        "kernel_ms": round(kernel_ms, 3),
        "loop_ms": round(loop_ms, 3),
        "speedup": round(loop_ms / kernel_ms, 2),
        "kernel_weight_gb_s": round(active * per_expert / kernel_ms / 1e6, 2),
        "max_rel_err": float(f"{err:.2e}"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1,32")
    parser.add_argument("--formats", default="fp32,int8")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=256)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    h, i, e = args.hidden, args.inter, args.experts
    torch.manual_seed(0)
    w13 = torch.randn(e, 2 * i, h) / h**0.5
    w2 = torch.randn(e, h, i) / i**0.5
    results = []
    for fmt in args.formats.split(","):
        experts = Experts(stacked(w13, fmt), stacked(w2, fmt), activation="silu")
        results += [measure(fmt, experts, int(n), args) for n in args.tokens.split(",")]
    report = {
        "shape": {"hidden": h, "inter": i, "experts": e, "top_k": args.top_k},
        "threads": torch.get_num_threads(),
        "load_avg": os.getloadavg(),
        "results": results,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""Gated-DeltaNet on the CPU (layers/gated_delta.py), one Qwen3.5-0.8B-like layer (16 key and
16 value heads of 128, conv kernel 4, bf16 activations, fp32 state), printing JSON.

    .venv/bin/python benchmarks/gdn_bench.py [--batches 1,8] [--prefill 512,2048]
        [--dtype bfloat16|float32] [--repeats 20] [--threads N] [--output FILE]

Decode: one step of R requests (slots spread over a pool of 4R, out of order), the recurrent
gated delta rule and the conv1d update before it, each by its C++ kernel (csrc/gated_delta.cpp)
and by the vectorized torch step ("speedup": the rule's). Prefill: one new request's tokens through the conv and the
chunked form. Medians of `--repeats`, on `--threads` threads (default: torch's, 2 on the CI
host). NOTE: on a loaded host the torch step (a dozen parallel ops, each a barrier) suffers
far more than the kernels (one parallel region each): compare runs on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from gemv_bench import median_ms  # benchmarks/ is the script's directory

from pagedllm.layers import gated_delta as gd
from pagedllm.layers.attention import cpu_kernels
from pagedllm.layers.gdn_meta import GdnMeta

SHAPE = gd.GdnShape(key_heads=16, value_heads=16, key_dim=128, value_dim=128, conv_kernel=4)


def _inputs(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    mixed = torch.randn(n, SHAPE.conv_dim).to(dtype)
    a, b = torch.randn(2, n, SHAPE.value_heads)
    g, beta = gd.gdn_gating(a, b, torch.rand(SHAPE.value_heads).log(), torch.randn(16))
    return mixed, g, beta


def decode(batch: int, dtype: torch.dtype, repeats: int) -> dict:
    state = SHAPE.new_state(4 * batch, dtype)
    state.ssm.normal_(0, 0.3)
    weight = torch.randn(SHAPE.conv_dim, SHAPE.conv_kernel).to(dtype)
    idx = torch.randperm(4 * batch)[:batch].to(torch.int32)
    init = torch.ones(batch, dtype=torch.int32)
    mixed, g, beta = _inputs(batch, dtype)
    q, k, v = SHAPE.split(gd.causal_conv1d_update(mixed, weight, None, state.conv, idx))

    def rule(kernel: bool) -> float:
        args = (q, k, v, g, beta, state.ssm, idx, init, True)
        return median_ms([lambda: gd._recurrent_step(*args, kernel=kernel)], repeats)[0]

    def conv(kernel: bool) -> float:
        args = (mixed, weight, None, state.conv, idx, init, "silu")
        return median_ms([lambda: gd._conv_update(*args, kernel=kernel)], repeats)[0]

    torch_ms = rule(False)
    result = {"requests": batch, "rule_torch_ms": torch_ms, "conv_torch_ms": conv(False)}
    if cpu_kernels.kernel_available():
        cpp_ms = rule(True)
        result |= {"rule_cpp_ms": cpp_ms, "conv_cpp_ms": conv(True), "speedup": torch_ms / cpp_ms}
        state_mb = batch * SHAPE.value_heads * SHAPE.key_dim * SHAPE.value_dim * 4 / 2**20
        result["cpp_state_gb_per_s"] = 2 * state_mb / 1024 / (cpp_ms / 1e3)  # read + write
    return result


def prefill(tokens: int, dtype: torch.dtype, repeats: int) -> dict:
    state = SHAPE.new_state(1, dtype)
    weight = torch.randn(SHAPE.conv_dim, SHAPE.conv_kernel).to(dtype)
    meta = GdnMeta.build([0, tokens], [0], [False])
    mixed, g, beta = _inputs(tokens, dtype)

    def step() -> torch.Tensor:
        q, k, v = SHAPE.split(gd.causal_conv1d(mixed, weight, None, state.conv, meta))
        return gd.gated_delta_rule(q, k, v, g, beta, state.ssm, meta)

    ms = median_ms([step], max(3, repeats // 4))[0]
    return {"tokens": tokens, "ms": ms, "tokens_per_s": tokens / ms * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prefill", default="512,2048")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    with torch.inference_mode():
        report = {
            "layer": {**SHAPE.__dict__, "dtype": args.dtype},
            "threads": torch.get_num_threads(),
            "decode": [decode(int(b), dtype, args.repeats) for b in args.batches.split(",")],
            "prefill": [prefill(int(n), dtype, args.repeats) for n in args.prefill.split(",")],
        }
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

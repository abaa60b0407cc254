"""Linear layers of SmolLM2-135M's shapes, every weight format, 1 to 256 rows: printing JSON.

    .venv/bin/python benchmarks/gemv_bench.py [--rows 1,16,32,64,128,256] [--output FILE]

For each format (fp32 / bf16 dense, int8 per channel, int4 groups of 32, and those two packed
sixteen rows at a time, as a CPU model holds them where the kernels take that: AVX-512 VNNI)
and each number of activation rows, the time of `layers.quant.linear` over the model's four
projection shapes plus lm_head (one decoder layer's worth of each, the head once: the mix of a decode step) on
the C++ kernels ("kernel") and on the path past `KERNEL_MAX_ROWS` ("fallback": oneDNN, after
decoding a quantized weight), next to PyTorch's own `F.linear` on the dense or dequantized
weight ("torch"), as medians of interleaved runs; and the weight bytes the kernels read per
second. Where "kernel" passes "fallback" is where `KERNEL_MAX_ROWS` belongs. Sequential, 2
threads, load average recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.layers import quant

# (N, K): fused qkv, o, fused gate/up, down, lm_head of SmolLM2-135M
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def median_ms(fns: list[Callable[[], object]], reps: int) -> list[float]:
    """Medians of `reps` interleaved runs of each function (drift hits them alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for f in fns:
        f()
    for _ in range(reps):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e3 for t in times]


def weights(fmt: str, w: torch.Tensor) -> quant.Weight:
    return {
        "fp32": lambda: w,
        "bf16": lambda: w.bfloat16(),
        "int8": lambda: quant.quantize_int8(w),
        "int4": lambda: quant.quantize_int4(w),
        "int8 packed": lambda: quant.quantize_int8(w).pack(),
        "int4 packed": lambda: quant.quantize_int4(w).pack(),
    }[fmt]()


def nbytes(weight: quant.Weight) -> int:
    if isinstance(weight, quant.QuantizedWeight):
        return weight.nbytes
    return weight.numel() * weight.element_size()


def with_max_rows(limit: int, pairs: list[tuple[torch.Tensor, quant.Weight]]) -> None:
    """quant.linear over `pairs` with the kernels taking up to `limit` rows (0: never)."""
    saved = dict(quant.KERNEL_MAX_ROWS)
    quant.KERNEL_MAX_ROWS.update({key: limit for key in saved})
    try:
        for x, w in pairs:
            quant.linear(x, w)
    finally:
        quant.KERNEL_MAX_ROWS.update(saved)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,32,64,128,256")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    dense = [torch.randn(n, k) * 0.05 for n, k in SHAPES]
    results = []
    load_before = os.getloadavg()
    packed = ("int8 packed", "int4 packed") if quant.packs_on_cpu() else ()
    for fmt in ("fp32", "bf16", "int8", "int4", *packed):
        ws = [weights(fmt, w) for w in dense]
        act = torch.bfloat16 if fmt == "bf16" else torch.float32
        refs = [w.dequantize(act) if isinstance(w, quant.QuantizedWeight) else w for w in ws]
        for rows in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(rows, k).to(act) for _, k in SHAPES]
            pairs, dense_pairs = list(zip(xs, ws, strict=True)), list(zip(xs, refs, strict=True))
            ms_kernel, ms_fallback, ms_torch = median_ms(
                [
                    lambda p=pairs: with_max_rows(1 << 30, p),
                    lambda p=pairs: with_max_rows(0, p),
                    lambda p=dense_pairs: [F.linear(x, w) for x, w in p],
                ],
                args.reps,
            )
            total = sum(nbytes(w) for w in ws)
            results.append(
                {
                    "format": fmt,
                    "rows": rows,
                    "kernel_ms": round(ms_kernel, 3),
                    "fallback_ms": round(ms_fallback, 3),
                    "torch_ms": round(ms_torch, 3),
                    "kernel_weight_gb_per_s": round(total / ms_kernel / 1e6, 2),
                    "weight_mb": round(total / 1e6, 1),
                }
            )
            print(json.dumps(results[-1]), flush=True)
    doc = {
        "threads": torch.get_num_threads(),
        "kernel_max_rows": quant.KERNEL_MAX_ROWS,
        "load_average_before_after": [load_before, os.getloadavg()],
        "torch_column": "F.linear on the dense weight (fp32, bf16) or on the weight "
        "dequantized beforehand (int8, int4): what the kernels replace",
        "results": results,
    }
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()

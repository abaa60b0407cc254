"""The CPU paged decode-attention kernel at SmolLM2-135M's shape, printing JSON.

    .venv/bin/python benchmarks/attention_bench.py [--configs 1x128,1x1024,8x1024,32x1024]
        [--dtypes bfloat16,float32] [--extension PATH.so ...] [--output FILE]

For each (batch x context) and KV dtype: the time of one layer's `paged_decode_attention`
(9 query heads, 3 KV heads, head_dim 64, blocks of 16 slots, each request's blocks in a
shuffled order), over 30 layers' caches in turn (as a decode step meets them: none in cache),
held on huge pages as the engine holds them (pagedllm.model.arena); and the KV bytes read
per second. `--extension` adds builds of the kernels from elsewhere (another commit's
`~/.cache/torch_extensions/.../pagedllm_cpu_attention_*.so`): all builds run interleaved,
round by round, so that a drifting machine hits them alike; medians. 2 threads, load average
recorded.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from pagedllm.layers.attention import cpu_kernels
from pagedllm.model.arena import Arena

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def load_extension(path: str) -> Any:
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_config(
    builds: dict[str, Any], batch: int, ctx: int, dtype: torch.dtype, rounds: int
) -> dict[str, Any]:
    blocks = -(-ctx // BLOCK)
    gen = torch.Generator().manual_seed(batch * ctx)
    cache = torch.randn(batch * blocks, BLOCK, 2, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    arena = Arena(cache.numel() * cache.element_size() * LAYERS + LAYERS * 64)
    caches = [arena.copy(cache) for _ in range(LAYERS)]
    order = torch.randperm(blocks, generator=gen)
    tables = torch.arange(batch * blocks).view(batch, blocks)[:, order].contiguous()
    lens = torch.full((batch,), ctx, dtype=torch.int64)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    out = torch.empty_like(q)
    times: dict[str, list[float]] = {name: [] for name in builds}
    for _ in range(rounds):
        for name, module in builds.items():
            start = time.perf_counter()
            for c in caches:
                module.paged_decode_attention(out, q, c, tables, lens, HEAD_DIM**-0.5, 0)
            times[name].append((time.perf_counter() - start) / LAYERS)
    kv_bytes = batch * ctx * 2 * KV_HEADS * HEAD_DIM * cache.element_size()
    row: dict[str, Any] = {"batch": batch, "context": ctx, "dtype": str(dtype).split(".")[1]}
    for name, ts in times.items():
        med = statistics.median(ts)
        row[name] = {
            "us_per_layer": round(med * 1e6, 1),
            "kv_gb_per_s": round(kv_bytes / med / 1e9, 2),
        }
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="1x128,1x1024,2x1024,4x1024,8x1024,32x1024")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--extension", action="append", default=[], help="another build's .so")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--output", help="also write the results here (JSON)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    module = cpu_kernels.load_kernels()
    assert module is not None, "the CPU kernels did not build"
    builds = {"this": module} | {Path(p).stem: load_extension(p) for p in args.extension}
    rows = []
    for dtype in args.dtypes.split(","):
        for cfg in args.configs.split(","):
            batch, ctx = (int(v) for v in cfg.split("x"))
            rows.append(one_config(builds, batch, ctx, getattr(torch, dtype), args.rounds))
            print(json.dumps(rows[-1]), flush=True)
    result = {
        "threads": 2,
        "loadavg": os.getloadavg(),
        "this": cpu_kernels.extension_name(),
        "rows": rows,
    }
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

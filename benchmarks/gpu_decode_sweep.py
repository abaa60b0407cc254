"""Decode attention on a GPU over its launch options, printing one JSON document: for SmolLM2's
and Llama-3-8B's head shapes at batch 32 over 2k/4k contexts (bf16), the time of
`paged_decode` inside a CUDA graph (as decode runs it) for each keys-per-iteration tile,
warp count and split count, its fraction of the measured copy bandwidth, and what the launch
table and split heuristic pick today (docs/gpu.md). Used to choose `decode_launch` and
`num_decode_splits`; every option must still compile without spills (tests/test_kernels_compile.py).

    python benchmarks/gpu_decode_sweep.py [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import copy_bandwidth, graphed_time

SHAPES = {"smollm2": (9, 3, 64), "llama3_8b": (32, 8, 128)}  # heads, kv heads, head dim


def main() -> None:
    from pagedllm.layers.attention.triton_kernels import paged_decode
    from pagedllm.layers.attention.triton_launch import (
        KernelConfig,
        decode_launch,
        num_decode_splits,
    )

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="the 2k context only")
    args = ap.parse_args()
    copy = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    base = KernelConfig(num_sms=sms)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_gb_s": round(copy / 1e9)}
    tiles, warps = [32, 64, 128], [4, 8]  # every launch the table may choose is among these
    for name, (heads, kv_heads, hd) in SHAPES.items():
        for ctx in [2048] if args.quick else [2048, 4096]:
            batch, block = 32, 16
            blocks = batch * ctx // block
            cache = torch.randn(blocks, 2, kv_heads, block, hd, device="cuda").to(torch.bfloat16)
            tables = torch.arange(blocks, dtype=torch.int32, device="cuda").view(batch, -1)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            q = torch.randn(batch, heads, hd, device="cuda").to(torch.bfloat16)
            o = torch.empty_like(q)
            kv_bytes = batch * ctx * 2 * kv_heads * hd * 2
            rows: list[dict[str, Any]] = []
            for tile in tiles:
                for w in warps:
                    cfg = dataclasses.replace(base, decode_block_n=tile, num_warps=w)
                    for splits in (1, 2, 4, 8, 16, 32):
                        call = (o, q, cache, tables, lens, 0.1, splits, None, cfg)
                        row: dict[str, Any] = {"tile": tile, "warps": w, "splits": splits}
                        try:
                            s = graphed_time(lambda call=call: paged_decode(*call))
                        except Exception as e:  # a launch the device refuses: say which
                            rows.append(row | {"error": str(e)[:200]})
                            continue
                        us, frac = round(s * 1e6, 1), round(kv_bytes / s / copy, 3)
                        rows.append(row | {"us": us, "of_copy": frac})
            launch = decode_launch(base, torch.bfloat16, hd, heads // kv_heads)
            chosen = {
                "tile": launch.block_n,
                "warps": launch.num_warps,
                "splits": num_decode_splits(batch, kv_heads, ctx, base),
            }
            timed = [r for r in rows if "us" in r]
            best = min(timed, key=lambda r: r["us"]) if timed else None
            now = next((r for r in timed if all(r[k] == v for k, v in chosen.items())), None)
            out[f"{name}_b{batch}_ctx{ctx}"] = {
                "chosen": chosen,
                "chosen_result": now,
                "best": best,
                "all": rows,
            }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

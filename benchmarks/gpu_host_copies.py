"""The sampler's per-step host tensors on a GPU, printing one JSON document: decode steps at
batch 1, or `--batch` (SmolLM2's shape, bf16, random weights, CUDA graphs) for three kinds of request
(sampled with top-k / top-p, sampled with a repetition penalty, greedy), the tensors copied as
the sampler copies them (`layers.attention.base.host_to_device`: pinned memory, non-blocking)
against plain `torch.tensor(values, device="cuda")`, whose copy from pageable memory waits for
the GPU's queued work (the step's graph), in interleaved rounds in one process. Also each
step's graph time on the GPU and the host overhead (1 - graph time / step time, median round).

    python benchmarks/gpu_host_copies.py [--steps 100] [--rounds 4] [--batch 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench as gb

from pagedllm import SamplingParams
from pagedllm.layers import sampler

KINDS = {
    "sampled_top_k_top_p": dict(temperature=0.8, top_p=0.9, top_k=50, seed=3),
    "sampled_repetition_penalty": dict(temperature=0.8, repetition_penalty=1.1),
    "greedy": dict(temperature=0),
}


def pageable(values: Any, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=100, help="steps per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    copies = {"pinned": sampler.host_to_device, "pageable": pageable}
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "batch": args.batch,
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = gb.random_checkpoint(Path(tmp) / "s", gb.SMOLLM2, torch.bfloat16, "cuda")
        # room for the batch, at least the engine's default 64 (the batch-1 runs so far)
        eng = gb.engine(model, "cuda", torch.bfloat16, False, max_num_seqs=max(args.batch, 64))
        graphs = eng.runner.graphs.graphs  # by size: the batch runs the smallest that holds it
        graph, _ = graphs[min(size for size in graphs if size >= args.batch)]
        for kind, kw in KINDS.items():
            params = SamplingParams(max_tokens=4000, ignore_eos=True, detokenize=False, **kw)
            ids = [f"{kind}-{i}" for i in range(args.batch)]
            for i, rid in enumerate(ids):
                eng.add_request(rid, list(range(3 + i, 35 + i)), params)
            for _ in range(30):
                eng.step()
            steps: dict[str, list[float]] = {name: [] for name in copies}
            for r in range(args.rounds):  # alternating which goes first
                for name in sorted(copies, reverse=r % 2 == 1):
                    sampler.host_to_device = copies[name]
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        eng.step()
                    torch.cuda.synchronize()
                    steps[name].append((time.perf_counter() - start) / args.steps * 1e6)
            sampler.host_to_device = copies["pinned"]
            for rid in ids:
                eng.abort_request(rid)
            gpu_us = gb.cuda_time(graph.replay) * 1e6
            row: dict[str, Any] = {"graph_gpu_us": round(gpu_us, 1)}
            for name, times in steps.items():
                median = sorted(times)[len(times) // 2]
                row[f"{name}_step_us"] = [round(t, 1) for t in times]
                row[f"{name}_host_overhead"] = round(1 - gpu_us / median, 3)
            out[kind] = row
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

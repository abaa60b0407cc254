"""Tensor parallelism for a mixture of experts: decode step time at each tensor-parallel size,
and the bytes the chosen split (every expert cut across the ranks) moves against what expert
parallelism would, printing one JSON document.

    .venv/bin/python benchmarks/moe_tp_bench.py [--quick] [--layers 4] [--sizes 1,2]
        [--batches 1,32] [--tokens 16] [--rounds 2] [--out FILE]

The model is moe_bench.py's Qwen3-MoE of Qwen3-30B-A3B's proportions (hidden 512, 64 experts
of width 192, top-8, fp32, random), `--layers` layers. Measured, per size and batch (8-token
prompts, `--tokens` decode steps; the sizes take turns within each of `--rounds` rounds, and
each keeps its best round): the median engine step, tok/s, and rank 0's wait in collectives
per step (tp_bench.py's `decode`). On the CPU every rank gets 1/N of the threads one rank had:
the same cores either way. Size 1 is measured twice, with all the threads and with one (`1@1`:
what each of 2 ranks gets; on a busy machine a 2-thread step waits for a descheduled thread).

Computed from the sizes, per token and MoE layer (`traffic`):
- the split here: the block's partial outputs take one all-reduce of the hidden state (as the
  attention's do: 2 a layer); a ring all-reduce sends 2 (N-1)/N of it from each rank;
- expert parallelism (whole experts per rank, attention data-parallel: each rank holds other
  tokens): an all-to-all of each token's hidden state to the ranks of its top-k experts and
  back, once per rank holding some (deduplicated, as DeepEP does) or once per expert;
- the expert weights each rank reads in a decode step (what bounds it): the split reads 1/N of
  every expert some token chose; expert parallelism, the whole experts chosen on its rank, so
  the step waits for the busiest rank (expected, with uniform routing: random tokens).
These for 2, 4 and 8 ranks, for this model and for Qwen3-30B-A3B itself in bf16 (hidden 2048,
128 experts of width 768, top-8).
`--quick`: one round of 8 decode steps, 2 layers (about a minute on a quiet 2-core machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_bench import EXPERTS, TOP_K, WIDTH, moe_config
from tp_bench import decode, log

from families import make_family_checkpoint  # (on sys.path through moe_bench)

TRAFFIC_SIZES = [2, 4, 8]


@dataclass(frozen=True)
class Shape:
    """What the traffic of one MoE layer depends on."""

    hidden: int
    experts: int
    top_k: int
    width: int  # each expert's intermediate width
    item: int  # bytes per value

    @property
    def expert_bytes(self) -> int:  # gate, up and down
        return 3 * self.hidden * self.width * self.item


# the benchmark's model, and Qwen3-30B-A3B itself in bf16 (what a GPU host would serve)
BENCH = Shape(hidden=512, experts=EXPERTS, top_k=TOP_K, width=WIDTH, item=4)
QWEN3_30B_A3B = Shape(hidden=2048, experts=128, top_k=8, width=768, item=2)


def all_reduce_bytes(m: Shape, world: int) -> dict[str, float]:
    """The MoE block's all-reduce per token: its payload, and what a ring sends per rank."""
    payload = m.hidden * m.item
    return {"payload": payload, "ring_sent_per_rank": round(2 * (world - 1) / world * payload, 1)}


def all_to_all_bytes(m: Shape, world: int) -> dict[str, float]:
    """Expert parallelism's dispatch + combine per token (uniform routing): to each other rank
    holding one of its experts once (deduplicated), or once per expert on another rank; and
    the deduplicated bytes per rank for each token of the batch (a rank holds 1/N of the
    tokens, where the all-reduce's ranks each hold all of them)."""
    per_rank = m.experts // world
    # P(a given rank holds none of the token's top-k experts)
    none = math.comb(m.experts - per_rank, m.top_k) / math.comb(m.experts, m.top_k)
    remote_ranks = (world - 1) * (1 - none)
    remote_experts = m.top_k * (world - 1) / world
    return {
        "remote_ranks": round(remote_ranks, 3),
        "deduplicated": round(2 * remote_ranks * m.hidden * m.item, 1),
        "deduplicated_per_rank": round(2 * remote_ranks * m.hidden * m.item / world, 1),
        "per_expert": round(2 * remote_experts * m.hidden * m.item, 1),
    }


def weight_reads(m: Shape, world: int, batch: int, draws: int = 500) -> dict[str, float]:
    """Expert weight bytes a rank reads per MoE layer in a step of `batch` decodes: the split
    (1/N of each chosen expert, the same on every rank) against expert parallelism's busiest
    rank (its whole chosen experts), with each token's top-k experts drawn uniformly."""
    rng = np.random.default_rng(0)
    split, busiest = [], []
    for _ in range(draws):
        chosen = np.zeros(m.experts, dtype=bool)
        for _ in range(batch):
            chosen[rng.choice(m.experts, m.top_k, replace=False)] = True
        split.append(chosen.sum() / world)
        busiest.append(chosen.reshape(world, -1).sum(axis=1).max())
    return {
        "split": round(float(np.mean(split)) * m.expert_bytes),
        "expert_parallel_busiest_rank": round(float(np.mean(busiest)) * m.expert_bytes),
    }


def traffic(m: Shape, sizes: list[int], batches: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"shape": dataclasses.asdict(m), "expert_bytes": m.expert_bytes}
    for world in sizes:
        out[str(world)] = {
            "all_reduce_per_token_per_moe_layer": all_reduce_bytes(m, world),
            "expert_parallel_all_to_all_per_token_per_moe_layer": all_to_all_bytes(m, world),
            "expert_weight_bytes_per_rank_per_layer": {
                f"batch_{b}": weight_reads(m, world, b) for b in batches
            },
        }
    return out


def main() -> None:
    import torch

    from pagedllm import LLM

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--sizes", default="1,2")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--quick", action="store_true", help="one round of 8 steps, 2 layers")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.tokens, args.layers = 1, 8, 2
    sizes = [int(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    cfg = moe_config(args.layers)
    threads = torch.get_num_threads()
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_family_checkpoint(Path(tmp) / "qwen3_moe", "qwen3_moe", **cfg)
        llms = {
            size: LLM(
                str(path), dtype="float32", device="cpu", tensor_parallel_size=size, max_num_seqs=32
            )
            for size in sizes
        }
        # (label, engine, torch threads of this process while it steps)
        runs = [
            (str(size), llm, threads if size == 1 else llm.engine.runner.workers.threads)
            for size, llm in llms.items()
        ]
        if 1 in llms and threads > 1:
            runs.insert(1, ("1@1", llms[1], 1))
        try:
            for r in range(args.rounds):
                for batch in batches:
                    for label, llm, n in runs:
                        torch.set_num_threads(n)
                        decode(llm, 1, 2)  # warm-up
                        got = decode(llm, batch, args.tokens)
                        log(f"round {r} tp={label} batch={batch}: {got}")
                        old = rows.setdefault(label, {}).get(f"batch_{batch}")
                        if old is None or got["step_ms"] < old["step_ms"]:
                            rows[label][f"batch_{batch}"] = got
        finally:
            for llm in llms.values():
                llm.close()
            torch.set_num_threads(threads)
    doc = {
        "moe": {k: v for k, v in cfg.items() if k != "initializer_range"},
        "dtype": "float32",
        "threads": threads,
        "decode_tokens": args.tokens,
        "rounds": args.rounds,
        "sizes": rows,
        "traffic_bytes": {
            "this_model": traffic(BENCH, TRAFFIC_SIZES, batches),
            "qwen3_30b_a3b_bf16": traffic(QWEN3_30B_A3B, TRAFFIC_SIZES, batches),
        },
    }
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
